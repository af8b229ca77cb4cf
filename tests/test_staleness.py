"""Only stale stages rerun: Snakemake's own dry-run on a built workflow, after real edits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.tokenizers_for_tests import build_chatml_tokenizer
from tests.workflow_runner import copy_workflow, planned, snakemake, write_config

pytestmark = pytest.mark.workflow

CHAT = [
    {
        "messages": [
            {"role": "user", "content": f"Count from {i} to {i + 4}."},
            {"role": "assistant", "content": ", ".join(str(n) for n in range(i, i + 5)) + "."},
        ]
    }
    for i in range(30)
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A workflow copy with a small verifier tokenizer and data, built up to the vocab map."""
    work = tmp_path_factory.mktemp("wf")
    verifier = build_chatml_tokenizer(work / "verifier")
    vocab_size = len(AutoTokenizer.from_pretrained(verifier))
    (verifier / "config.json").write_text(
        json.dumps({"hidden_size": 8, "num_hidden_layers": 4, "vocab_size": vocab_size})
    )
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    config = {
        "verifier": "verifier",
        "chat_data": "chat.jsonl",
        "eval_prompts": "chat.jsonl",
        "vocab": {"draft_vocab_size": 64},
    }
    copy_workflow(work, config)
    snakemake(work, "--cores", "2", "vocab_map")
    return work, config


def edit(path: Path, old: str, new: str) -> str:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return text


def test_no_change_plans_nothing(built):
    work, _ = built
    assert planned(work, "vocab_map") == {}


def test_vocab_size_change_plans_vocab_not_prepare(built):
    work, config = built
    write_config(work, {**config, "vocab": {"draft_vocab_size": 32}})
    try:
        assert planned(work, "vocab_map") == {"vocab": 1}
    finally:
        write_config(work, config)


def test_prepare_change_plans_prepare_and_downstream(built):
    work, config = built
    write_config(work, {**config, "prepare": {"max_seq_len_tokens": 100}})
    try:
        assert planned(work, "vocab_map") == {"prepare": 1, "vocab": 1}
    finally:
        write_config(work, config)


def test_data_change_plans_everything(built):
    work, _ = built
    data = work / "chat.jsonl"
    original = data.read_text()
    data.write_text(original + json.dumps(CHAT[0]) + "\n")
    try:
        assert planned(work, "vocab_map") == {"prepare": 1, "vocab": 1}
    finally:
        data.write_text(original)


@pytest.mark.parametrize(
    "script, expected",
    [("stages/vocab.py", {"vocab": 1}), ("stages/prepare.py", {"prepare": 1, "vocab": 1})],
)
def test_code_change_reruns_that_stage(built, script, expected):
    work, _ = built
    path = work / "workflow_scripts" / script
    original = edit(path, '"""', '"""Edited. ')
    try:
        assert planned(work, "vocab_map") == expected
    finally:
        path.write_text(original)


def test_bad_config_fails_dry_run_naming_the_key(built):
    work, config = built
    write_config(work, {**config, "prepare": {"max_seqlen": 100}})
    try:
        proc = snakemake(work, "-n", "vocab_map", check=False)
        assert proc.returncode != 0
        assert "did you mean 'prepare.max_seq_len_tokens'" in proc.stdout + proc.stderr
    finally:
        write_config(work, config)


def test_regenerate_switch_plans_regenerate_then_prepare(built):
    """Switching regenerate on puts it before prepare; while it is off, its settings rerun
    nothing."""
    work, config = built
    write_config(work, {**config, "regenerate": {"enabled": True, "use_gpus": False}})
    try:
        assert planned(work, "vocab_map") == {
            "regenerate": 1,
            "regenerate_merge": 1,
            "prepare": 1,
            "vocab": 1,
        }
        write_config(work, {**config, "regenerate": {"enabled": False, "temperature": 0.7}})
        assert planned(work, "vocab_map") == {}
    finally:
        write_config(work, config)
