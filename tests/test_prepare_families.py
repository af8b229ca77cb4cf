"""prepare on the chat data of today's reasoning and tool-calling verifiers: for each family's
chat template (tests/chat_families.py: Qwen3, Kimi-K2-Thinking and K2.5, DeepSeek-R1 and V3.1,
gpt-oss, Llama-3.1, GLM-4.5, Mistral), on a tokenizer holding its special tokens, a set of 36
conversations (reasoning as a field and inline, tool-call chains): no conversation lost, each
assistant turn supervised exactly as the verifier generates it after the prompt it is served,
nothing else supervised; and the reasoning it refuses or resolves: a <think> block never closed,
reasoning fields that disagree, reasoning where the served verifier writes none."""

from __future__ import annotations

import io
import json
import re

import pytest
from transformers import AutoTokenizer

from tests.chat_families import FAMILIES, build_tokenizer, conversation_set
from workflow_scripts.lib.chat.tokenization import (
    read_conversation,
    tokenize_chat_file,
    tokenize_rows,
)
from workflow_scripts.lib.chat.rows import BadRow
from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.common import Progress, UserError

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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """served(name, kwargs): the family's ChatTemplate with ``kwargs``, its tokenizer built once
    per module."""
    paths: dict = {}

    def get(name: str, kwargs: dict) -> ChatTemplate:
        if name not in paths:
            paths[name] = build_tokenizer(FAMILIES[name], tmp_path_factory.mktemp(name))
        tokenizer = AutoTokenizer.from_pretrained(paths[name])
        return ChatTemplate(tokenizer, kwargs, "2026-01-01", paths[name])

    return get


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
    assert stats["dropped"] == {} and stats["reasoning_fields_disagree"] == 0
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


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_an_unclosed_think_block_is_a_bad_row(family, tmp_path):
    """Reasoning cut off before its </think> (as at a length limit): a bad row of its own
    reason, never supervised; under fail named with file, line and the setting."""
    fam, template, rows = family
    cut = {"messages": [user("question"), {"role": "assistant", "content": "<think>cut off at"}]}
    with pytest.raises(BadRow) as err:
        tokenize_rows(template, read_conversation(cut), MAX_LEN)
    assert err.value.reason == "unclosed_think"
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n" + json.dumps(cut) + "\n")
    stats = tokenize_chat_file(data, template, MAX_LEN, "skip", io.StringIO(), Progress("t", None))
    assert stats["dropped"] == {"unclosed_think": 1} and stats["conversations_out"] == 1
    where = re.escape(f"{data}:2: message 1 opens a <think> block")
    with pytest.raises(UserError, match=where + ".*prepare.on_bad_row: skip"):
        tokenize_chat_file(data, template, MAX_LEN, "fail", io.StringIO(), Progress("t", None))


@pytest.mark.parametrize("name", [name for name, fam in FAMILIES.items() if fam.reasoning])
def test_reasoning_fields_that_disagree_are_counted_and_the_first_by_precedence_kept(
    served, tmp_path, name
):
    """Two reasoning fields with different texts: reasoning_content, then reasoning, then
    thinking is the one supervised, whichever the template reads; each such assistant message
    counted in the statistics; the same text under two names is no disagreement."""
    row = {
        "messages": [
            user("question one"),
            {"role": "assistant", "content": "answer one", "reasoning_content": "kept one",
             "thinking": "dropped one"},
            user("question two"),
            {"role": "assistant", "content": "answer two", "reasoning": "same two",
             "thinking": "same two"},
            user("question three"),
            {"role": "assistant", "content": "answer three", "reasoning": "kept three",
             "thinking": "dropped three"},
        ]
    }  # fmt: skip
    template = served(name, FAMILIES[name].serving_kwargs)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(row) + "\n")
    out = io.StringIO()
    stats = tokenize_chat_file(data, template, MAX_LEN, "fail", out, Progress("t", None))
    assert stats["reasoning_fields_disagree"] == 2, stats
    written = [json.loads(line) for line in out.getvalue().splitlines()]
    supervised = " ".join(
        template.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in written
    )
    for text in ("kept one", "same two", "kept three"):
        assert text in supervised, (text, supervised)
    assert "dropped" not in supervised, supervised


CALL_ID = "functions.get_weather:0"  # as Kimi's template prints it in place of the name
CALL = {"id": CALL_ID, "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
RESULT = {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": "sunny"}
WITH_REASONING = [
    [user("question"), {"role": "assistant", "content": "answer", "reasoning_content": "why"}],
    [user("question"), {"role": "assistant", "content": "<think>why</think>answer"}],
    # the reasoning only on the answer after a tool result, where DeepSeek-V3.1 serves no
    # generation prompt at all
    [user("question"), {"role": "assistant", "content": "", "tool_calls": [CALL]}, RESULT,
     {"role": "assistant", "content": "answer", "thinking": "why"}],
]  # fmt: skip


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("deepseek_v31", {}),
        ("qwen3", {"enable_thinking": False}),
        ("kimi_k25", {"thinking": False}),
        ("glm45", {"enable_thinking": False}),
        ("llama31", {}),
    ],
)
def test_reasoning_where_the_verifier_writes_none_is_a_bad_row(served, name, kwargs):
    """A template whose generation prompt closes thinking (DeepSeek-V3.1 by default, Qwen3, GLM
    and Kimi-K2.5 with thinking off) refuses a turn's reasoning as Llama 3.1's, which renders
    none: the same reason, naming what to change; the same turns without their reasoning are
    supervised with no <think> block."""
    template = served(name, kwargs)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    for messages in WITH_REASONING:
        conv = read_conversation({"tools": tools, "messages": messages})
        with pytest.raises(BadRow) as err:
            tokenize_rows(template, conv, MAX_LEN)
        assert err.value.reason == "reasoning_not_rendered", (messages, str(err.value))
        assert "drop the reasoning" in str(err.value), str(err.value)
        for msg in conv.messages:
            msg.pop("reasoning", None)
        rows, _ = tokenize_rows(template, conv, MAX_LEN)
        texts = [template.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m]) for r in rows]
        assert "answer" in texts[-1] and not any("<think>" in t for t in texts), (name, texts)


def test_prompts_tokenized_from_the_turn_before_are_the_whole_prompts_ids(family):
    """prepare linear in the turns: a prompt that extends the turn before is tokenized from its
    stop token on (chat/turns.py); every conversation's turns and rows are the same as with
    every prompt tokenized whole, and the conversations of several turns do take that path
    where the family's template keeps the history as it served it."""
    from workflow_scripts.lib.chat.turns import conversation_turns, pack_rows

    fam, template, rows = family
    extended = 0
    for raw in rows:
        conv = read_conversation(raw)
        try:
            whole = conversation_turns(template, conv, whole=True)
        except BadRow as exc:
            with pytest.raises(BadRow, match=re.escape(exc.detail)):
                conversation_turns(template, conv)
            continue
        linear = conversation_turns(template, conv)
        assert [(t.message, t.prompt_ids, t.generated_ids, t.kinds) for t in linear] == [
            (t.message, t.prompt_ids, t.generated_ids, t.kinds) for t in whole
        ], raw["id"]
        assert [(r.input_ids, r.loss_mask, r.turns) for r in pack_rows(linear)] == [
            (r.input_ids, r.loss_mask, r.turns) for r in pack_rows(whole)
        ], raw["id"]
        extended += sum(t.extends_previous for t in linear)
    assert template.fresh_after  # each family's end-of-turn token: a fresh start after it
    # DeepSeek's templates drop the reasoning of every earlier turn: no prompt extends another
    assert extended > 0 or fam.name.startswith("deepseek"), fam.name


def test_a_tokenizer_that_does_not_start_afresh_after_the_stop_token_tokenizes_whole(
    tmp_path, monkeypatch
):
    """Qwen3's tokenizer with <|im_end|> taking the whitespace after it (rstrip, as some
    tokenizers' end tokens do): the probe finds that a prompt cannot be tokenized from the turn
    before, so every prompt is tokenized whole; and were the probe wrong, the check of each
    row's last prompt finds the ids differ and the conversation is tokenized again, whole: the
    rows are the tokenizer's either way."""
    from workflow_scripts.lib.chat import turns
    from workflow_scripts.lib.chat.turns import conversation_turns, pack_rows

    path = build_tokenizer(FAMILIES["qwen3"], tmp_path)
    spec = json.loads((path / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        if token["content"] == "<|im_end|>":
            token["rstrip"] = True
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((path / "tokenizer_config.json").read_text())
    for token in config.get("added_tokens_decoder", {}).values():
        if token["content"] == "<|im_end|>":
            token["rstrip"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate(AutoTokenizer.from_pretrained(path), {}, "2026-01-01", path)
    im_end = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in template.stop_ids and im_end not in template.fresh_after
    conv = read_conversation(conversation_set("qwen3")[-1])  # a tool-call chain
    whole = conversation_turns(template, conv, whole=True)
    assert len(whole) > 1 and not any(
        t.extends_previous for t in conversation_turns(template, conv)
    )
    template.fresh_after = frozenset(template.stop_ids)  # the probe overruled
    checks = []
    verified = turns._verified
    monkeypatch.setattr(turns, "_verified", lambda *a: checks.append(verified(*a)) or checks[-1])
    linear = conversation_turns(template, conv)
    assert False in checks  # the row's check found the ids differ, and tokenized whole
    assert [(r.input_ids, r.loss_mask) for r in pack_rows(linear)] == [
        (r.input_ids, r.loss_mask) for r in pack_rows(whole)
    ]
