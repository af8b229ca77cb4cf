"""prepare on the chat data of today's reasoning and tool-calling verifiers: for each family's
chat template (tests/chat_families.py: Qwen3, Kimi-K2-Thinking and K2.5, DeepSeek-R1 and V3.1,
gpt-oss, Llama-3.1, GLM-4.5, Mistral), on a tokenizer holding its special tokens, a set of 36
conversations (reasoning as a field and inline, tool-call chains): no conversation lost, each
assistant turn supervised exactly as the verifier generates it after the prompt it is served,
nothing else supervised."""

from __future__ import annotations

import io
import json

import pytest
from transformers import AutoTokenizer

from tests.chat_families import FAMILIES, build_tokenizer, conversation_set
from workflow_scripts.lib.chat.dataset import read_conversation, tokenize_chat_file, tokenize_rows
from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.common import Progress

MAX_LEN = 1 << 20


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, its ChatTemplate with the arguments it is served with, its 36 rows)."""
    fam = FAMILIES[request.param]
    path = build_tokenizer(fam, tmp_path_factory.mktemp(fam.name))
    template = ChatTemplate(
        AutoTokenizer.from_pretrained(path), fam.serving_kwargs, "2026-01-01", path
    )
    return fam, template, conversation_set(fam)


def runs(row):
    """The supervised spans of a row: (start, end) token positions."""
    spans, start = [], None
    for i, m in enumerate(row.loss_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_no_conversation_is_lost(family, tmp_path):
    """The whole set through prepare's file loop (bad rows fail): every conversation kept, and
    the cost of exactness counted: rows per conversation, extracted against unique tokens."""
    fam, template, rows = family
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = io.StringIO()
    stats = tokenize_chat_file(data, template, MAX_LEN, "fail", out, Progress("t", None))
    assert stats["rows_in"] == stats["conversations_out"] == 36, stats
    assert stats["dropped"] == {}
    written = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(written) == stats["rows_out"] >= 36
    assert {r["source_line"] for r in written} == set(range(1, 37))
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in written)
    assert 1.0 <= stats["extracted_over_unique"] < 1.6, stats
    kinds = stats["supervised_tokens_by_kind"]
    assert kinds["answer"] > 0 and kinds["tool_call"] > 0 and kinds["stop"] > 0
    assert (kinds["reasoning"] > 0) == fam.reasoning
    print(fam.name, {k: stats[k] for k in ("rows_out", "extracted_over_unique")}, kinds)


def test_each_turn_is_supervised_exactly_as_generated(family):
    """Per assistant turn: its supervised tokens follow exactly the prompt it is served (the
    template with its generation prompt over the messages before it), end with a stop token of
    the verifier's generation config, hold that stop token once, and hold its reasoning, answer
    and tool calls' names; no user text, system text or tool result is supervised."""
    fam, template, rows = family
    decode = template.decode
    for raw in rows:
        conv = read_conversation(raw)
        built, _ = tokenize_rows(template, conv, MAX_LEN)
        spans = [(row, span) for row in built for span in runs(row)]
        turns = [j for row in built for j in row.turns]
        assert len(spans) == len(turns) == sum(m["role"] == "assistant" for m in conv.messages)
        others = [m["content"] for m in conv.messages if m["role"] != "assistant" and m["content"]]
        for (row, (start, end)), j in zip(spans, turns):
            prompt = template.prompt_ids(conv.messages[:j], conv.tools)
            assert row.input_ids[:start] == prompt, (raw["id"], j)
            ids = row.input_ids[start:end]
            assert ids[-1] in template.stop_ids, (raw["id"], j, decode(ids))
            assert sum(t in template.stop_ids for t in ids) == 1, (raw["id"], j)
            text = decode(ids)
            said = conv.texts(j)
            for value in [said["reasoning"], said["answer"], *said["tool_names"]]:
                assert value in text, (raw["id"], j, value, text)
            assert not any(other in text for other in others), (raw["id"], j, text)


def test_history_rewriting_templates_take_a_row_per_rewritten_prompt(family):
    """Where a template renders the history stably (Llama 3.1), a conversation is one row;
    where it drops earlier reasoning after a new user message, a two-turn conversation with
    reasoning takes two."""
    fam, template, rows = family
    counts = [len(tokenize_rows(template, read_conversation(r), MAX_LEN)[0]) for r in rows[:12]]
    if fam.name == "llama31":
        assert counts == [1] * 12
    elif fam.reasoning:
        assert counts == [2] * 12


def test_regenerated_text_splits_into_the_reasoning_and_answer_it_was_made_of(family):
    """What regeneration does with a turn the verifier generates (here: the text each family
    generates for the data's turns): split where the template writes reasoning, the reasoning
    and the answer come back as they were."""
    from workflow_scripts.lib.chat.turns import template_turn

    fam, template, rows = family
    for raw in rows[:24]:  # the two-turn conversations: reasoning as a field, and inline
        conv = read_conversation(raw)
        for j, msg in enumerate(conv.messages):
            if msg["role"] != "assistant":
                continue
            prompt_ids, _, ids = template_turn(template, conv, j)
            body = ids[:-1] if ids[-1] in template.stop_ids else ids
            reasoning, answer = template.split_reasoning(
                template.decode(prompt_ids), template.decode(body)
            )
            said = conv.texts(j)
            assert answer == said["answer"], (raw["id"], j)
            assert (reasoning or "") == said["reasoning"], (raw["id"], j)
