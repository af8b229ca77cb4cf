"""A trained draft exported for SGLang and TensorRT-LLM (lib/draft/export.py, the export rule):
the flat Llama config both read, each engine's auxiliary-layer convention and tensor names, its
serve command; refused, at the dry-run and by the job, where the engine cannot serve the draft as
it was trained; and, on the real model's build, each export served by vLLM (which reads the same
layout) with the draft's own greedy tokens and acceptance, and a residual convention served wrong
seen in the acceptance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_dry_run_targets import check_run
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.draft.checkpoint import speculators_config, write_draft_checkpoint
from workflow_scripts.lib.draft.export import (
    SERVE_SCRIPT,
    TRTLLM_OPTIONS,
    DraftShape,
    export_draft,
    serving_problems,
)
from workflow_scripts.lib.draft.layer_config import draft_layer_config
from workflow_scripts.lib.draft.model import DraftConfig, Eagle3Draft
from workflow_scripts.lib.workflow.layout import Layout

VERIFIER = {  # a Llama of 6 layers with a rope theta not the default's
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256, "rope_theta": 50000.0, "tie_word_embeddings": False,
}  # fmt: skip
AUX = [2, 3, 4]
SERVABLE = {"norm_before_residual": False}


def write_draft(directory: Path, layer: str = "llama", **settings) -> Path:
    """A draft of VERIFIER as training writes one (untrained weights, 48 draft tokens)."""
    settings = {**SERVABLE, **settings}
    window = settings.pop("sliding_window", None)
    cfg = DraftConfig.from_layer_config(
        draft_layer_config(VERIFIER, layer), 48, sliding_window=window, **settings
    )
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    config = speculators_config(
        layer_config=cfg.layer_config, draft_vocab_size=48, aux_layer_ids=AUX,
        num_speculative_tokens=3, verifier_name_or_path="/models/verifier",
        verifier_architectures=VERIFIER["architectures"],
        norm_before_residual=cfg.norm_before_residual, norm_before_fc=cfg.norm_before_fc,
    )  # fmt: skip
    d2t = torch.arange(48) * 2 - torch.arange(48)  # draft id i is verifier id 2i
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[::2] = True
    write_draft_checkpoint(directory, model.checkpoint_state_dict(), config, d2t, t2d)
    return directory


def test_the_export_is_the_drafts_tensors_in_each_engines_layout(tmp_path):
    draft = write_draft(tmp_path / "draft", norm_before_fc=True)
    ours = load_file(draft / "model.safetensors")
    for engine, renamed in (("sglang", "layers.0."), ("trtllm", "midlayer.")):
        out = tmp_path / engine
        written = export_draft(draft, out, engine)
        assert SERVE_SCRIPT in written and "config.json" in written
        theirs = load_file(out / "model.safetensors")
        assert {n.replace("layers.0.", renamed) for n in ours} == set(theirs)
        for name, tensor in ours.items():
            assert theirs[name.replace("layers.0.", renamed)].equal(tensor), name
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["draft_vocab_size"] == 48 and config["vocab_size"] == 96
        assert config["num_hidden_layers"] == 1 and config["norm_before_residual"] is False
        assert config["norm_before_fc"] is True and config["tie_word_embeddings"] is False
        # vLLM reads the top-level ids as they are; SGLang the nested ones, adding 1
        assert config["eagle_aux_hidden_state_layer_ids"] == AUX
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert "transformer_layer_config" not in config
        # transformers before 5 read rope_theta; transformers 5 reads it too
        from transformers import AutoConfig

        read = AutoConfig.from_pretrained(out)
        assert config["rope_theta"] == 50000.0 and read.rope_parameters["rope_theta"] == 50000.0
        serve = (out / SERVE_SCRIPT).read_text()
        assert "/models/verifier" in serve and (out / SERVE_SCRIPT).stat().st_mode & 0o100
    sglang = (tmp_path / "sglang" / SERVE_SCRIPT).read_text()
    assert "--speculative-algorithm EAGLE3" in sglang and str((tmp_path / "sglang").resolve())
    assert "--speculative-num-steps 3 " in sglang and "--speculative-num-draft-tokens 4" in sglang
    options = (tmp_path / "trtllm" / TRTLLM_OPTIONS).read_text()
    assert "eagle3_layers_to_capture: [1, 2, 3]" in options and "max_draft_len: 3" in options


@pytest.mark.parametrize(
    "layer, settings, says",
    [
        ("llama", {"norm_before_residual": True}, "set train.norm_before_residual: false"),
        ("llama", {"sliding_window": 16}, "set train.sliding_window_tokens: null"),
        ("llama", {"num_layers": 2}, "set train.num_draft_layers: 1"),
        ("qwen3", {}, "train.draft_layer qwen3: {engine} has no EAGLE-3 draft of that layer"),
    ],
)
def test_a_draft_an_engine_cannot_serve_as_trained_is_not_exported(tmp_path, layer, settings, says):
    draft = write_draft(tmp_path / "draft", layer, **settings)
    for engine, name in (("sglang", "SGLang"), ("trtllm", "TensorRT-LLM")):
        with pytest.raises(ValueError) as exc:
            export_draft(draft, tmp_path / engine, engine)
        assert says.format(engine=name) in str(exc.value)
        assert not (tmp_path / engine).exists()


def test_the_auxiliary_layers_each_engine_cannot_take():
    """Any number of them in SGLang 0.5.23 (its fc takes num_aux_hidden_states); none of them the
    embeddings (id 0) in TensorRT-LLM, which captures layers' outputs."""
    shape = DraftShape("llama", 1, (0, 3, 4, 5), None, False)
    assert serving_problems(shape, "sglang") == []
    (trtllm,) = serving_problems(shape, "trtllm")
    assert "auxiliary layer 0 (the embeddings)" in trtllm
    assert serving_problems(DraftShape("llama", 1, None, None, False), "trtllm") == []


def test_the_dry_run_says_which_engines_serve_the_draft_and_refuses_an_export_they_cannot(
    tmp_path,
):
    recipe = {"train": {"sliding_window_tokens": 512}}  # config.yaml's: a window, and true
    _, said = check_run(tmp_path, recipe, ["draft_ckpt"])
    assert (
        "info",
        "the draft will be served by vLLM; not by SGLang nor TensorRT-LLM "
        "(train.sliding_window_tokens 512, train.norm_before_residual true): "
        "docs/gpu-and-slurm.md#serving-on-sglang-and-tensorrt-llm",
    ) in said
    with pytest.raises(UserError) as exc:
        check_run(tmp_path, recipe, ["export_trtllm"])
    assert str(exc.value).startswith(
        "target export_trtllm cannot be built: TensorRT-LLM cannot serve the draft"
    )
    assert "set train.norm_before_residual: false and train again" in str(exc.value)
    servable = {"train": {"sliding_window_tokens": None, "norm_before_residual": False}}
    _, said = check_run(tmp_path, servable, ["export_sglang", "export_trtllm"])
    assert ("info", "the draft will be served by vLLM and SGLang and TensorRT-LLM") in said
    _, said = check_run(tmp_path, {"train": {**servable["train"], "draft_layer": "qwen3"}}, ["all"])
    assert any(
        "vLLM; not by SGLang nor TensorRT-LLM (train.draft_layer qwen3)" in t for _, t in said
    )


def test_the_real_models_build_exports_its_draft_for_both_engines(real_build):
    """The workflow's export targets on the real model's build (a draft trained with
    norm_before_residual false): both layouts written, the real verifier's RoPE and vocabulary in
    their config, its tied embedding shipped as the draft's own."""
    work, _ = real_build
    layout = Layout(work / "results")
    draft = load_file(layout.train.draft / "model.safetensors")
    verifier = json.loads((layout.demo.verifier / "config.json").read_text())
    for engine in ("sglang", "trtllm"):
        out = layout.export.draft(engine)
        config = json.loads((out / "config.json").read_text())
        assert config["rope_theta"] == verifier["rope_parameters"]["rope_theta"] == 100000.0
        assert config["vocab_size"] == 49152 and config["torch_dtype"] == "bfloat16"
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # 30 layers' default
        theirs = load_file(out / "model.safetensors")
        assert theirs["embed_tokens.weight"].equal(draft["embed_tokens.weight"])
    options = (layout.export.draft("trtllm") / TRTLLM_OPTIONS).read_text()
    assert "eagle3_layers_to_capture: [1, 14, 26]" in options


@pytest.mark.engine
def test_the_exports_are_served_by_vllm_with_the_drafts_tokens_and_acceptance(
    full_build, demo_build, tmp_path
):
    """The embedded default's draft as the full build trains it (norm_before_residual false, full
    attention) and the build's exports of it for SGLang and TensorRT-LLM (the workflow's export
    targets), served by vLLM (which loads their layout too, midlayer.* included): the same greedy
    tokens, drafts and accepted tokens at every position. The SGLang export with its config
    saying true is served beside them and accepts less: a convention read wrong would show."""
    from tests.test_checkpoint_vllm import _prompts, run_spec_decode

    work, _ = full_build
    built = Layout(work / "results")
    config = json.loads((built.train.draft / "config.json").read_text())
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    drafts = {}  # linked here: the requests' files are written beside each draft
    for name, path in (
        ("speculators", built.train.draft),
        ("sglang", built.export.draft("sglang")),
        ("trtllm", built.export.draft("trtllm")),
    ):
        drafts[name] = tmp_path / name
        drafts[name].symlink_to(path.resolve(), target_is_directory=True)
    drafts["wrong"] = tmp_path / "sglang_served_as_true"
    shutil.copytree(built.export.draft("sglang"), drafts["wrong"])
    config = json.loads((drafts["wrong"] / "config.json").read_text())
    (drafts["wrong"] / "config.json").write_text(
        json.dumps({**config, "norm_before_residual": True})
    )
    runs = run_spec_decode(
        Path(demo_build["verifier"]), list(drafts.values()), _prompts(demo_build, 16), 48
    )
    served = dict(zip(drafts, runs))
    ours = served["speculators"]
    print({name: run["mean_acceptance_length"] for name, run in served.items()})
    assert ours["mean_acceptance_length"] > 2.0, ours["counters"]
    for name in ("sglang", "trtllm"):
        assert served[name]["outputs"] == ours["outputs"], name
        assert served[name]["counters"] == ours["counters"], name
    # the other convention changes what the draft proposes (the counters above would show it),
    # and this draft accepts less under it (2.90 against 3.02 here)
    assert served["wrong"]["counters"] != ours["counters"]
    assert served["wrong"]["mean_acceptance_length"] < ours["mean_acceptance_length"] - 0.05
