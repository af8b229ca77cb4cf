"""evaluate's prompts: the rows it takes, and every bad row named with file and line (the
engines themselves run in tests/test_pipeline.py; sets in other layouts in tests/test_data.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.bad_rows import EVERY_BAD_ROW, refusing_tokenizer
from tests.tokenizers_for_tests import build_chatml_tokenizer
from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.evaluation.acceptance import load_prompt_sets
from workflow_scripts.lib.workflow.sources import PromptSource

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The chat template (ChatML, refusing one message) as evaluate serves it."""
    chatml = build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))
    path = refusing_tokenizer(tmp_path_factory.mktemp("refusing"), chatml)
    return ChatTemplate(AutoTokenizer.from_pretrained(path), verifier_dir=path)


def load_prompts(path: Path, template, limit: int | None) -> list[dict]:
    """The prompts of one file, as evaluate reads a set."""
    return load_prompt_sets([PromptSource(path=str(path))], template, limit)


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
    path = write(tmp_path / "p.jsonl", rows)
    prompts = load_prompts(path, tokenizer, None)
    assert [p["id"] for p in prompts] == ["a", f"{path}:3", f"{path}:4"]
    assert {p["set"] for p in prompts} == {"p"}
    assert prompts[0]["prompt_token_ids"] == tokenizer.prompt_ids(QUESTION)
    assert prompts[0]["prompt_token_ids"] == prompts[1]["prompt_token_ids"]
    assert len(load_prompts(tmp_path / "p.jsonl", tokenizer, 2)) == 2
    one = PromptSource(path=str(path), rows=1)
    assert len(load_prompt_sets([one], tokenizer, 2)) == 1  # the set's own rows
    with pytest.raises(UserError, match=r"p.jsonl:1: the prompt has \d+ tokens.*max_model_len"):
        load_prompt_sets([one], tokenizer, None, max_len=3)


BAD_PROMPTS = [raw for raw, reason in EVERY_BAD_ROW if reason != "no_assistant_tokens"] + [
    json.dumps({"prompt": 5}).encode(),
    json.dumps({"messages": QUESTION + [{"role": "assistant", "content": "Paris."}]}).encode(),
]


@pytest.mark.parametrize("raw", BAD_PROMPTS, ids=range(len(BAD_PROMPTS)))
def test_every_bad_prompt_is_named_with_file_and_line(tokenizer, tmp_path, raw):
    path = write(tmp_path / "p.jsonl", [json.dumps({"messages": QUESTION}).encode(), raw])
    with pytest.raises(UserError, match=rf"{re.escape(str(path))}:2: not a usable prompt: "):
        load_prompts(path, tokenizer, None)


def test_prompts_carry_tools_earlier_turns_and_tool_results(tmp_path):
    """A prompt row may hold earlier turns, tool calls, a tool result last, and a tools list: the
    prompt is the template's render of all of it with the generation prompt, with the
    serving-time arguments (here a date the template prints)."""
    from tests.chat_families import FAMILIES, build_tokenizer

    path = build_tokenizer(FAMILIES["gpt_oss"], tmp_path / "gpt_oss")
    template = ChatTemplate(AutoTokenizer.from_pretrained(path), {}, "2025-03-04", path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    row = {
        "tools": tools,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        ],
    }
    prompts = load_prompts(write(tmp_path / "p.jsonl", [json.dumps(row).encode()]), template, None)
    text = template.decode(prompts[0]["prompt_token_ids"])
    assert "get_weather" in text and '"sunny"' in text and "2025-03-04" in text
    assert text.endswith("<|start|>assistant")
