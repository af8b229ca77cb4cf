"""The embedded default: generated data, tokenizer and chat template, verifier directory.

Fast tests build a small demo through the real script. The test marked ``slow`` uses the
full-size build of ``demo_build`` (conftest.py): held-out accuracy (vLLM's agreement with
transformers on the same verifier is in tests/test_vllm_cpu.py).
Fast only: ``pytest tests/test_demo.py -m "not slow"``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY_VERIFIER, run_demo
from workflow_scripts.lib.chat.tokenization import tokenize_conversation
from workflow_scripts.lib.demo import conversations as demo_data
from workflow_scripts.lib.demo import verifier as demo

SMALL = dict(
    num_conversations=40,
    num_eval_prompts=6,
    **TINY_VERIFIER,
    train_steps=3,
    train_batch_size_samples=4,
)
VERIFIER_FILES = [
    "demo_report.json",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    return run_demo(tmp_path_factory.mktemp("small_demo"), **SMALL)


@pytest.fixture(scope="module")
def small_tokenizer(small_build):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(small_build["verifier"])


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


# --------------------------------------------------------------------------- data


def test_same_seed_gives_identical_bytes(small_build, tmp_path):
    again = run_demo(tmp_path, **SMALL)
    for key in ("chat_data", "eval_prompts"):
        assert small_build[key].read_bytes() == again[key].read_bytes(), key
    for name in VERIFIER_FILES:
        first = (small_build["verifier"] / name).read_bytes()
        assert first == (again["verifier"] / name).read_bytes(), name


def test_written_data_is_the_seeded_generation(small_build):
    rows = demo_data.generate_conversations(0, SMALL["num_conversations"])
    assert small_build["chat_data"].read_text(encoding="utf-8") == demo_data.dumps_jsonl(rows)
    assert demo_data.dumps_jsonl(demo_data.generate_conversations(1, 40)) != demo_data.dumps_jsonl(
        rows
    )


def check_conversation(row: dict) -> None:
    assert set(row) == {"id", "messages"} and isinstance(row["id"], str)
    messages = row["messages"]
    assert messages[0]["role"] == "system" and messages[0]["content"] in demo_data.SYSTEM_PROMPTS
    turns = messages[1:]
    assert len(turns) in (2, 4, 6), row
    for i, msg in enumerate(turns):
        assert set(msg) == {"role", "content"}
        assert msg["role"] == ("user" if i % 2 == 0 else "assistant")
        assert isinstance(msg["content"], str) and msg["content"] == msg["content"].strip()
        assert msg["content"]


def test_default_data_schema_and_rules():
    rows = demo_data.generate_conversations(0, 1200)
    assert len(rows) == 1200 and len({r["id"] for r in rows}) == 1200
    answers: dict[str, set[str]] = defaultdict(set)
    exchanges = set()
    for row in rows:
        check_conversation(row)
        turns = row["messages"][1:]
        exchanges.add(len(turns) // 2)
        for user, assistant in zip(turns[::2], turns[1::2]):
            answers[user["content"]].add(assistant["content"])
            assert not demo_data.is_held_out(user["content"])
    assert exchanges == {1, 2, 3}
    # the answer is a function of the question: a question always gets the same answer
    assert all(len(a) == 1 for a in answers.values())
    assert len({r["messages"][0]["content"] for r in rows}) == len(demo_data.SYSTEM_PROMPTS)


def test_eval_prompts_are_held_out(small_build):
    evals = read_jsonl(small_build["eval_prompts"])
    assert len(evals) == SMALL["num_eval_prompts"]
    default = demo_data.generate_eval_prompts(0, 48)
    train_users = {
        m["content"]
        for row in demo_data.generate_conversations(0, 1200)
        for m in row["messages"]
        if m["role"] == "user"
    }
    for row in evals + default:
        assert [m["role"] for m in row["messages"]] == ["system", "user"]
        assert row["messages"][-1]["content"] not in train_users
        assert row["reference"] and row["family"] in demo_data.FAMILIES
    assert len({r["messages"][-1]["content"] for r in default}) == 48
    assert {r["family"] for r in default} == set(demo_data.FAMILIES)


def test_too_many_eval_prompts_fails_cleanly_and_leaves_nothing(tmp_path):
    with pytest.raises(AssertionError, match="num_eval_prompts"):
        run_demo(tmp_path, **{**SMALL, "num_eval_prompts": 100_000})
    assert not any(tmp_path.iterdir())


def test_killed_build_leaves_nothing_that_looks_finished(tmp_path):
    """A build killed during training leaves no output file, at its own name, behind."""
    from workflow_scripts.lib.workflow import cli
    from workflow_scripts.lib.workflow.definitions import DemoParams

    files = {
        "verifier": tmp_path / "verifier",
        "chat_data": tmp_path / "chat_data.jsonl",
        "eval_prompts": tmp_path / "eval_prompts.jsonl",
    }
    args = cli.render("demo", DemoParams(**{**SMALL, "train_steps": 100_000}), files)
    proc = subprocess.Popen(
        f"{sys.executable} -m workflow_scripts.stages.demo {args}",
        shell=True,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in proc.stderr:  # progress is logged from the first training step
            if "step 1/" in line:
                break
        else:
            pytest.fail("no progress line before the script ended")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not any(path.exists() for path in files.values())


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens_and_template(small_tokenizer):
    tok = small_tokenizer
    assert len(tok) == SMALL["tokenizer_vocab_size"]
    for special in demo.SPECIAL_TOKENS:
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert ids == [tok.convert_tokens_to_ids(special)], special
    assert tok.eos_token == "<|eot_id|>" and tok.bos_token == "<|begin_of_text|>"
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": " Count from 3 to 6. "},
        {"role": "assistant", "content": "3, 4, 5, 6."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nCount from 3 to 6.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n3, 4, 5, 6.<|eot_id|>"
    )
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # the text survives encoding and decoding, also text the tokenizer never saw in training
    for sample in (text, "Zebras & 42 quokkas: ünïcödé ✓\n\ttabs"):
        ids = tok(sample, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == sample
    # no special token is added besides those of the template
    assert tok("hello")["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]


def expected_mask(tok, messages) -> list[int]:
    """1 exactly from the end of each assistant turn's generation prompt to its <|eot_id|>."""
    full = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    mask = [0] * len(full["input_ids"])
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        start = len(tok(before, add_special_tokens=False)["input_ids"])
        end = len(tok(through, add_special_tokens=False)["input_ids"])
        mask[start:end] = [1] * (end - start)
    return mask


def test_mask_is_assistant_content_and_eot(small_build, small_tokenizer):
    tok = small_tokenizer
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    for row in read_jsonl(small_build["chat_data"]):
        messages = row["messages"]
        sample = tokenize_conversation(tok, messages, 4096)
        assert sample.loss_mask == expected_mask(tok, messages), row["id"]
        # the masked runs decode to exactly the assistant contents, each closed by <|eot_id|>
        runs, run = [], []
        for token, m in zip(sample.input_ids, sample.loss_mask):
            if m:
                run.append(token)
            elif run:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [r[-1] for r in runs] == [eot] * len(replies)
        assert [tok.decode(r[:-1]) for r in runs] == replies


# --------------------------------------------------------------------------- verifier


def test_verifier_directory_loads_with_transformers(small_build, small_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    verifier = small_build["verifier"]
    assert (
        sorted(p.name for p in small_build["verifier"].parent.iterdir() if p.name.startswith("."))
        == []
    )
    for name in VERIFIER_FILES:
        assert (verifier / name).is_file(), name
    config = json.loads((verifier / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == len(small_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(verifier)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.config.hidden_size == SMALL["hidden_size"]
    assert model.config.num_hidden_layers == SMALL["num_hidden_layers"]
    assert model.config.num_key_value_heads == SMALL["num_key_value_heads"]
    eot = small_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot in GenerationConfig.from_pretrained(verifier).eos_token_id
    tokenizer_config = json.loads((verifier / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == demo.CHAT_TEMPLATE
    report = json.loads((verifier / "demo_report.json").read_text())
    assert 0 <= report["eval"]["exact_match"] <= 1


# --------------------------------------------------------------------------- full size (slow)


@pytest.mark.slow
def test_trained_verifier_answers_held_out_prompts(demo_build):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_build["verifier"])
    model = AutoModelForCausalLM.from_pretrained(demo_build["verifier"]).eval()
    evals = read_jsonl(demo_build["eval_prompts"])
    result = demo.evaluate(model, tok, evals)
    assert result["exact_match"] >= 0.9, result
    # answers of 20-80 tokens, as the speculative decoding stages expect
    lengths = sorted(len(tok(r["reference"], add_special_tokens=False)["input_ids"]) for r in evals)
    assert 15 <= lengths[len(lengths) // 2] <= 80, lengths
