"""evaluate's prompt file: the prompts it takes, and every bad row named with file and line
(the engines themselves run in tests/test_pipeline.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.bad_rows import EVERY_BAD_ROW, refusing_tokenizer
from tests.tokenizers_for_tests import build_chatml_tokenizer
from workflow_scripts.lib.chat import prompt_ids
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.evaluation import load_prompts

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    chatml = build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))
    return AutoTokenizer.from_pretrained(
        refusing_tokenizer(tmp_path_factory.mktemp("refusing"), chatml)
    )


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_prompts_from_both_row_kinds(tokenizer, tmp_path):
    rows = [
        json.dumps({"id": "a", "prompt": QUESTION[0]["content"]}).encode(),
        b"",
        json.dumps({"messages": QUESTION}).encode(),
        json.dumps({"conversations": [{"from": "human", "value": "hi"}]}).encode(),
    ]
    prompts = load_prompts(write(tmp_path / "p.jsonl", rows), tokenizer, None)
    assert [p["id"] for p in prompts] == ["a", "line3", "line4"]
    assert prompts[0]["prompt_token_ids"] == prompt_ids(tokenizer, QUESTION)
    assert prompts[0]["prompt_token_ids"] == prompts[1]["prompt_token_ids"]
    assert len(load_prompts(tmp_path / "p.jsonl", tokenizer, 2)) == 2


BAD_PROMPTS = [raw for raw, reason in EVERY_BAD_ROW if reason != "no_assistant_tokens"] + [
    json.dumps({"prompt": 5}).encode(),
    json.dumps({"messages": QUESTION + [{"role": "assistant", "content": "Paris."}]}).encode(),
]


@pytest.mark.parametrize("raw", BAD_PROMPTS, ids=range(len(BAD_PROMPTS)))
def test_every_bad_prompt_is_named_with_file_and_line(tokenizer, tmp_path, raw):
    path = write(tmp_path / "p.jsonl", [json.dumps({"messages": QUESTION}).encode(), raw])
    with pytest.raises(UserError, match=rf"{re.escape(str(path))}:2: not a usable prompt: "):
        load_prompts(path, tokenizer, None)
