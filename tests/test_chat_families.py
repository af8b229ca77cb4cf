"""The chat-family fixtures: each template renders its family's documented behaviour, the
tokenizers carry the special and stop tokens, and every conversation row renders."""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

from tests.chat_families import (
    FAMILIES,
    Family,
    _corpus,
    all_tokens,
    build_tokenizer,
    conversation_set,
)

DS_EOS = "<｜end▁of▁sentence｜>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """tok(name): the family's tokenizer, built by build_tokenizer once per module."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            out = build_tokenizer(name, tmp_path_factory.mktemp(name))
            cache[name] = AutoTokenizer.from_pretrained(out)
        return cache[name]

    return get


def render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def asst(content: str = "", **fields) -> dict:
    return {"role": "assistant", "content": content, **fields}


def call(name: str = "get_weather", arguments=None, call_id: str = "call_1") -> dict:
    arguments = {"city": "Paris"} if arguments is None else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def result(content: str = "sunny", call_id: str = "call_1", name: str = "get_weather") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def template_messages(fam: Family, row: dict) -> list[dict]:
    """A row as the messages a data stage hands the template: ShareGPT mapped, ipython/function
    roles mapped to tool, tool-call arguments in the form the template takes."""
    if "conversations" in row:
        roles = {"human": "user", "gpt": "assistant", "system": "system"}
        return [{"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]]
    messages = copy.deepcopy(row["messages"])
    for m in messages:
        if m["role"] in ("ipython", "function"):
            m["role"] = "tool"
        for tc in m.get("tool_calls", []):
            args = tc["function"]["arguments"]
            if fam.tool_arguments == "string" and not isinstance(args, str):
                tc["function"]["arguments"] = json.dumps(args)
            elif fam.tool_arguments == "mapping" and isinstance(args, str):
                tc["function"]["arguments"] = json.loads(args)
    return messages


# ------------------------------------------------------------------------------------------------
# Every family


@pytest.mark.parametrize("name", FAMILIES)
def test_every_special_token_is_one_id(tok, name):
    t = tok(name)
    for token in all_tokens(name):
        assert t.encode(token, add_special_tokens=False) == [t.convert_tokens_to_ids(token)], token


@pytest.mark.parametrize("name", FAMILIES)
def test_template_markers_are_special_tokens(name):
    fam = FAMILIES[name]
    markers = re.findall(r"<\|[a-z_]+\|>|<｜[^｜]+｜>|\[/?[A-Za-z_]+\]", fam.template)
    assert set(markers) <= set(all_tokens(fam))


@pytest.mark.parametrize("name", FAMILIES)
def test_stop_tokens_are_in_generation_config(tmp_path, name):
    fam = FAMILIES[name]
    out = build_tokenizer(fam, tmp_path)
    t = AutoTokenizer.from_pretrained(out)
    config = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == [t.convert_tokens_to_ids(s) for s in fam.stop_tokens]
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == fam.template
    assert (t.bos_token, t.eos_token, t.pad_token) == (fam.bos_token, fam.eos_token, fam.pad_token)


@pytest.mark.parametrize("name", FAMILIES)
def test_build_tokenizer_stays_small(name, tmp_path):
    """Every test that builds a family's tokenizer trains it: its corpus and vocabulary stay small
    (37k to 47k characters and a vocabulary of 900 today, a few hundredths of a second), bounded
    by size rather than by a clock, which a loaded machine would fail."""
    assert sum(len(text) for text in _corpus(FAMILIES[name])) < 100_000
    tok = AutoTokenizer.from_pretrained(build_tokenizer(name, tmp_path))
    assert len(tok) <= 900


@pytest.mark.parametrize("name", FAMILIES)
def test_conversation_set_shape(name):
    fam = FAMILIES[name]
    rows = conversation_set(name)
    assert len(rows) == 36 and len({r["id"] for r in rows}) == 36
    assert sum("conversations" in r for r in rows) == 4
    chains = [r for r in rows if "tools" in r]
    assert len(chains) == 12
    calls = [m["tool_calls"][0] for r in chains for m in r["messages"] if "tool_calls" in m]
    assert sum(isinstance(c["function"]["arguments"], str) for c in calls) == 6
    assert {m["role"] for r in chains for m in r["messages"][-2:-1]} == {
        "tool",
        "ipython",
        "function",
    }
    fields = {k for r in rows for m in r.get("messages", []) for k in m} & {
        "reasoning_content",
        "reasoning",
        "thinking",
    }
    assert fields == ({"reasoning_content", "reasoning", "thinking"} if fam.reasoning else set())
    if name.startswith("kimi"):
        assert all(re.fullmatch(r"functions\.\w+:\d+", c["id"]) for c in calls)
    if name == "mistral":
        assert all(len(c["id"]) == 9 for c in calls)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_row_renders_and_keeps_its_texts(tok, name):
    fam = FAMILIES[name]
    for row in conversation_set(name):
        messages = template_messages(fam, row)
        text = render(tok(name), messages, tools=row.get("tools"), **fam.serving_kwargs)
        for m in messages:
            if m["role"] in ("user", "tool"):
                assert m["content"] in text, (row["id"], m["content"])
            if m["role"] == "assistant" and m["content"]:
                answer = m["content"].split("</think>")[-1].strip()
                assert answer in text, (row["id"], answer)
        for tool in row.get("tools", [])[:1]:
            assert tool["function"]["name"] in text


@pytest.mark.parametrize("name", FAMILIES)
def test_conversation_texts_are_distinct(name):
    fam = FAMILIES[name]
    texts: list[str] = []
    for row in conversation_set(name):
        texts += [t["function"]["name"] for t in row.get("tools", [])]
        for m in template_messages(fam, row):
            texts += [m.get(k) for k in ("reasoning_content", "reasoning", "thinking") if k in m]
            texts += [p.strip() for p in re.split(r"</?think>", m["content"]) if p.strip()]
    assert all(t.isascii() for t in texts)
    assert len(set(texts)) == len(texts)
    assert not [(a, b) for a in texts for b in texts if a != b and a in b]


@pytest.mark.parametrize("name", FAMILIES)
def test_rendered_rows_decode_back_to_the_text(tok, name):
    fam, t = FAMILIES[name], tok(name)
    for row in conversation_set(name)[::7]:
        text = render(t, template_messages(fam, row), tools=row.get("tools"), **fam.serving_kwargs)
        assert t.decode(t(text, add_special_tokens=False)["input_ids"]) == text


# ------------------------------------------------------------------------------------------------
# Qwen3


def test_qwen3_drops_reasoning_before_last_user(tok):
    msgs = [
        user("U1"),
        asst("A1", reasoning_content="R1"),
        user("U2"),
        asst("A2", reasoning_content="R2"),
    ]
    text = render(tok("qwen3"), msgs)
    assert "R1" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert "<think>\nR2\n</think>\n\nA2" in text


def test_qwen3_final_turn_gets_empty_think_block(tok):
    text = render(tok("qwen3"), [user("U1"), asst("A1")])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nA1<|im_end|>\n")


def test_qwen3_empty_block_lasts_only_while_turn_is_last(tok):
    text = render(tok("qwen3"), [user("U1"), asst("A1"), user("U2")])
    assert "<|im_start|>assistant\nA1<|im_end|>" in text and "<think>" not in text


def test_qwen3_nonfinal_tool_turn_without_reasoning_gets_no_block(tok):
    msgs = [user("U1"), asst(tool_calls=[call()]), result(), asst("A1")]
    assert "<|im_start|>assistant\n<tool_call>" in render(tok("qwen3"), msgs)


def test_qwen3_tool_chain_after_last_user_keeps_reasoning(tok):
    msgs = [user("U1"), asst(tool_calls=[call()], reasoning_content="R1"), result(), asst("A1")]
    assert "<think>\nR1\n</think>\n\n<tool_call>" in render(tok("qwen3"), msgs)


@pytest.mark.parametrize(
    "kwargs, reasoning",
    [({}, "R1"), ({"enable_thinking": True}, "R1"), ({"enable_thinking": False}, None)],
)
def test_qwen3_gen_prompt_is_prefix_of_turn_render(tok, kwargs, reasoning):
    fields = {"reasoning_content": reasoning} if reasoning else {}
    prompt = render(tok("qwen3"), [user("U1")], add_generation_prompt=True, **kwargs)
    assert render(tok("qwen3"), [user("U1"), asst("A1", **fields)], **kwargs).startswith(prompt)


def test_qwen3_enable_thinking_false_prefills_empty_block(tok):
    on = render(tok("qwen3"), [user("U1")], add_generation_prompt=True)
    off = render(tok("qwen3"), [user("U1")], add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"


def test_string_prefix_is_not_token_prefix(tok):
    t = tok("qwen3")
    prompt, block = "<think>\n", "<think>\n\n</think>\n\n"
    ids = t(block, add_special_tokens=False)["input_ids"]
    assert block.startswith(prompt) and len(ids) == 4
    prompt_ids = t(prompt, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] != prompt_ids


@pytest.mark.parametrize("field", ["reasoning", "thinking"])
def test_qwen3_ignores_other_reasoning_fields(tok, field):
    text = render(tok("qwen3"), [user("U1"), asst("A1", **{field: "R1"})])
    assert "R1" not in text


def test_qwen3_splits_inline_think_from_content(tok):
    text = render(tok("qwen3"), [user("U1"), asst("<think>\nR1\n</think>\n\nA1")])
    assert text.endswith("<think>\nR1\n</think>\n\nA1<|im_end|>\n")


def test_qwen3_tool_results_merged_into_one_user_turn(tok):
    msgs = [user("U1"), asst(tool_calls=[call(), call()]), result("T1"), result("T2")]
    text = render(tok("qwen3"), msgs)
    merged = "<|im_start|>user\n<tool_response>\nT1\n</tool_response>\n<tool_response>\nT2\n"
    assert merged + "</tool_response><|im_end|>\n" in text
    assert "</tool_call>\n<tool_call>" in text


def test_qwen3_string_arguments_verbatim(tok):
    text = render(tok("qwen3"), [user("U1"), asst(tool_calls=[call(arguments='{"city":"X"}')])])
    assert '{"name": "get_weather", "arguments": {"city":"X"}}' in text


def test_qwen3_list_content_is_empty_and_no_query(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "U1"}]}, asst("A1")]
    text = render(tok("qwen3"), msgs)
    assert "<|im_start|>user\n<|im_end|>" in text and "<think>" not in text


# ------------------------------------------------------------------------------------------------
# Kimi K2-Thinking and K2.5


@pytest.mark.parametrize("name", ["kimi_k2_thinking", "kimi_k25"])
def test_kimi_final_answer_drops_its_own_reasoning(tok, name):
    text = render(tok(name), [user("U1"), asst("A1", reasoning_content="R1")])
    assert text.endswith("<|im_middle|><think></think>A1<|im_end|>") and "R1" not in text


@pytest.mark.parametrize("name", ["kimi_k2_thinking", "kimi_k25"])
def test_kimi_tool_turn_after_last_answer_keeps_reasoning(tok, name):
    id_ = "functions.get_weather:0"
    msgs = [user("U1"), asst(tool_calls=[call(call_id=id_)], reasoning_content="R1")]
    assert "<think>R1</think><|tool_calls_section_begin|>" in render(tok(name), msgs)
    answered = render(tok(name), [*msgs, result(call_id=id_), asst("A1")])
    assert "R1" not in answered


def test_kimi_default_system_message(tok):
    text = render(tok("kimi_k2_thinking"), [user("U1")])
    assert text.startswith(
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
        "<|im_end|><|im_user|>user<|im_middle|>U1<|im_end|>"
    )


def test_kimi_tools_ids_and_results(tok):
    id_ = "functions.get_weather:0"
    msgs = [user("U1"), asst(tool_calls=[call(call_id=id_)]), result("T1", call_id=id_)]
    text = render(tok("kimi_k2_thinking"), msgs, tools=[WEATHER])
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps([WEATHER]))
    assert f'<|tool_call_begin|>{id_}<|tool_call_argument_begin|>{{"city": "Paris"}}' in text
    assert f"<|im_system|>get_weather<|im_middle|>## Return of {id_}\nT1<|im_end|>" in text
    assert "<|im_end|>\n" not in text


def test_kimi_missing_tool_call_id(tok):
    msgs = [user("U1"), {"role": "tool", "content": "T1"}]
    assert "<|im_system|>tool<|im_middle|>## Return of \nT1" in render(
        tok("kimi_k2_thinking"), msgs
    )


def test_kimi_k2_thinking_gen_prompt_has_no_think(tok):
    prompt = render(tok("kimi_k2_thinking"), [user("U1")], add_generation_prompt=True)
    assert prompt.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_kimi_k25_gen_prompt_opens_think(tok):
    prompt = render(tok("kimi_k25"), [user("U1")], add_generation_prompt=True)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")


def test_kimi_k25_thinking_false_closes_think(tok):
    off = render(tok("kimi_k25"), [user("U1")], add_generation_prompt=True, thinking=False)
    assert off.endswith("<|im_middle|><think></think>")
    other = render(tok("kimi_k25"), [user("U1")], add_generation_prompt=True, enable_thinking=False)
    assert other.endswith("<|im_middle|><think>")


def test_kimi_k25_declares_tools_in_typescript(tok):
    text = render(tok("kimi_k25"), [user("U1")], tools=[WEATHER])
    assert "namespace functions {" in text and "type get_weather = (_: {\n" in text
    assert "city: string," in text


# ------------------------------------------------------------------------------------------------
# DeepSeek R1 and V3.1


def test_deepseek_r1_cuts_reasoning_even_on_last_turn(tok):
    msgs = [user("U1"), asst("<think>\nR1\n</think>\n\nA1", reasoning_content="R2")]
    text = render(tok("deepseek_r1"), msgs)
    assert text.endswith("<｜Assistant｜>\n\nA1" + DS_EOS) and "R1" not in text and "R2" not in text
    assert text.startswith("<｜begin▁of▁sentence｜><｜User｜>U1")


def test_deepseek_r1_gen_prompt_is_not_prefix(tok):
    prompt = render(tok("deepseek_r1"), [user("U1")], add_generation_prompt=True)
    assert prompt.endswith("<｜Assistant｜><think>\n")
    full = render(tok("deepseek_r1"), [user("U1"), asst("<think>\nR1\n</think>\n\nA1")])
    assert not full.startswith(prompt)


def test_deepseek_r1_tool_calls_in_json_blocks(tok):
    msgs = [user("U1"), asst(tool_calls=[call(arguments='{"city": "Paris"}')]), result("T1")]
    text = render(tok("deepseek_r1"), [*msgs, asst("A1")])
    assert (
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' + DS_EOS
    ) in text
    outputs = "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>T1<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    assert text.endswith(outputs + "A1" + DS_EOS)


def test_deepseek_r1_dict_arguments_raise(tok):
    with pytest.raises(TypeError):
        render(tok("deepseek_r1"), [user("U1"), asst(tool_calls=[call()])])


@pytest.mark.parametrize(
    "kwargs, tail",
    [
        ({}, "<｜Assistant｜></think>"),
        ({"thinking": True}, "<｜Assistant｜><think>"),
        ({"enable_thinking": True}, "<｜Assistant｜><think>"),
    ],
)
def test_deepseek_v31_gen_prompt(tok, kwargs, tail):
    assert render(tok("deepseek_v31"), [user("U1")], add_generation_prompt=True, **kwargs).endswith(
        tail
    )


@pytest.mark.parametrize("thinking, prefix_stable", [(False, True), (True, False)])
def test_deepseek_v31_thinking_prompt_is_not_prefix(tok, thinking, prefix_stable):
    prompt = render(
        tok("deepseek_v31"), [user("U1")], add_generation_prompt=True, thinking=thinking
    )
    full = render(tok("deepseek_v31"), [user("U1"), asst("A1")], thinking=thinking)
    assert full.startswith(prompt) is prefix_stable


def test_deepseek_v31_history_drops_reasoning(tok):
    msgs = [user("U1"), asst("<think>R1</think>A1", reasoning_content="R2")]
    text = render(tok("deepseek_v31"), msgs, thinking=True)
    assert text.endswith("<｜User｜>U1<｜Assistant｜></think>A1" + DS_EOS)
    assert "R1" not in text and "R2" not in text


def test_deepseek_v31_no_gen_prompt_after_tool_result(tok):
    msgs = [user("U1"), asst(tool_calls=[call(arguments="{}")]), result("T1")]
    prompt = render(tok("deepseek_v31"), msgs, add_generation_prompt=True)
    assert prompt == render(tok("deepseek_v31"), msgs)
    assert prompt.endswith("<｜tool▁output▁begin｜>T1<｜tool▁output▁end｜>")


def test_deepseek_v31_tool_calls_take_string_arguments(tok):
    msgs = [user("U1"), asst(tool_calls=[call(arguments='{"city": "Paris"}')])]
    text = render(tok("deepseek_v31"), msgs)
    assert text.endswith(
        "<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>' + DS_EOS
    )


def test_deepseek_v31_dict_arguments_raise(tok):
    with pytest.raises(TypeError):
        render(tok("deepseek_v31"), [user("U1"), asst(tool_calls=[call()])])


# ------------------------------------------------------------------------------------------------
# gpt-oss


def test_gpt_oss_final_after_tool_call_drops_analysis_from_full_render(tok):
    t = tok("gpt_oss")
    msgs = [user("U1"), asst(tool_calls=[call()], thinking="R1"), result("T1")]
    prompt = render(t, msgs, add_generation_prompt=True)
    full = render(t, [*msgs, asst("A1", thinking="R2")])
    analysis = "<|start|>assistant<|channel|>analysis<|message|>R1<|end|>"
    assert analysis in prompt and analysis not in full
    assert not full.startswith(prompt)


def test_gpt_oss_last_turn_keeps_analysis_and_returns(tok):
    msgs = [user("U1"), asst("A1", thinking="R1"), user("U2"), asst("A2", thinking="R2")]
    text = render(tok("gpt_oss"), msgs)
    assert "R1" not in text and "<|channel|>final<|message|>A1<|end|>" in text
    assert text.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>R2<|end|>"
        "<|start|>assistant<|channel|>final<|message|>A2<|return|>"
    )


def test_gpt_oss_reads_thinking_only(tok):
    text = render(tok("gpt_oss"), [user("U1"), asst("A1", reasoning_content="R1")])
    assert "R1" not in text


def test_gpt_oss_system_effort_and_date(tok):
    before = datetime.now().strftime("%Y-%m-%d")
    default = render(tok("gpt_oss"), [user("U1")])
    after = datetime.now().strftime("%Y-%m-%d")
    assert "Reasoning: medium" in default
    assert re.search(r"Current date: (\d{4}-\d{2}-\d{2})", default).group(1) in {before, after}
    assert "Reasoning: high" in render(tok("gpt_oss"), [user("U1")], reasoning_effort="high")


def test_gpt_oss_only_first_tool_call(tok):
    msgs = [user("U1"), asst(tool_calls=[call("first_tool"), call("second_tool")])]
    text = render(tok("gpt_oss"), msgs)
    assert "to=functions.first_tool<|channel|>commentary json" in text
    assert "second_tool" not in text


def test_gpt_oss_tool_result_quoted_with_previous_call_name(tok):
    msgs = [user("U1"), asst(tool_calls=[call()]), result("sunny", name="other_name")]
    text = render(tok("gpt_oss"), msgs)
    assert text.endswith(
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
    )


def test_gpt_oss_string_arguments_double_encoded(tok):
    text = render(tok("gpt_oss"), [user("U1"), asst(tool_calls=[call(arguments='{"city": "P"}')])])
    assert '<|message|>"{\\"city\\": \\"P\\"}"<|call|>' in text


def test_gpt_oss_raises_on_channel_markers_and_on_content_with_thinking(tok):
    with pytest.raises(TemplateError):
        render(tok("gpt_oss"), [user("U1"), asst("x<|channel|>final<|message|>A1")])
    with pytest.raises(TemplateError):
        render(tok("gpt_oss"), [user("U1"), asst("C1", thinking="R1", tool_calls=[call()])])


def test_gpt_oss_gen_prompt(tok):
    prompt = render(tok("gpt_oss"), [user("U1")], add_generation_prompt=True)
    assert prompt.endswith("<|start|>user<|message|>U1<|end|><|start|>assistant")


# ------------------------------------------------------------------------------------------------
# Llama 3.1


def test_llama31_two_tool_calls_raise(tok):
    with pytest.raises(TemplateError):
        render(tok("llama31"), [user("U1"), asst(tool_calls=[call(), call()])])
    with pytest.raises(TemplateError):
        render(tok("llama31"), [user("U1"), asst("A1", tool_calls=[])])


def test_llama31_string_results_json_quoted(tok):
    msgs = [user("U1"), asst(tool_calls=[call()]), result("sunny")]
    text = render(tok("llama31"), msgs)
    assert text.endswith('<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>')
    ipython = [*msgs[:2], {**msgs[2], "role": "ipython"}]
    assert render(tok("llama31"), ipython) == text


def test_llama31_tool_call_format(tok):
    msgs = [user("U1"), asst("not shown", tool_calls=[call(arguments='{"city": "P"}')])]
    text = render(tok("llama31"), msgs)
    assert text.endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": "{\\"city\\": \\"P\\"}"}<|eot_id|>'
    )
    assert "not shown" not in text


def test_llama31_date_default_and_kwarg(tok):
    assert "Today Date: 26 Jul 2024\n\n" in render(tok("llama31"), [user("U1")])
    assert "Today Date: 01 Jan 2030" in render(
        tok("llama31"), [user("U1")], date_string="01 Jan 2030"
    )


def test_llama31_tools_in_first_user_message(tok):
    msgs = [{"role": "system", "content": "S1"}, user("U1"), asst("A1"), user("U2")]
    text = render(tok("llama31"), msgs, tools=[WEATHER])
    first_user = text.split("<|start_header_id|>user<|end_header_id|>\n\n")[1].split("<|eot_id|>")[
        0
    ]
    assert json.dumps(WEATHER, indent=4) + "\n\nU1" in first_user and first_user.endswith("U1")
    assert "Environment: ipython\n" in text.split("<|eot_id|>")[0]
    moved = render(tok("llama31"), msgs, tools=[WEATHER], tools_in_user_message=False)
    assert json.dumps(WEATHER, indent=4) in moved.split("<|eot_id|>")[0]
    with pytest.raises(TemplateError):
        render(tok("llama31"), [{"role": "system", "content": "S1"}], tools=[WEATHER])


def test_llama31_trims_content(tok):
    text = render(tok("llama31"), [user("  U1  "), asst("  A1  ")])
    assert "\n\nU1<|eot_id|>" in text and text.endswith("\n\nA1<|eot_id|>")


def test_llama31_builtin_tools_end_with_eom(tok):
    msgs = [user("U1"), asst(tool_calls=[call("brave_search", {"query": "Q1"})])]
    text = render(tok("llama31"), msgs, builtin_tools=["brave_search", "wolfram_alpha"])
    assert text.endswith('<|python_tag|>brave_search.call(query="Q1")<|eom_id|>')
    assert "Tools: brave_search, wolfram_alpha\n\n" in text


def test_llama31_is_prefix_stable(tok):
    t = tok("llama31")
    msgs = [user("U1"), asst("A1"), user("U2"), asst("A2")]
    prompt = render(t, msgs[:3], add_generation_prompt=True)
    assert render(t, msgs).startswith(render(t, msgs[:2])) and render(t, msgs).startswith(prompt)


# ------------------------------------------------------------------------------------------------
# GLM-4.5


def test_glm45_prefix_and_no_end_token_after_assistant(tok):
    msgs = [user("U1"), asst("A1"), user("U2"), asst("A2")]
    text = render(tok("glm45"), msgs)
    assert text.startswith("[gMASK]<sop><|user|>\nU1<|assistant|>")
    assert "\nA1<|user|>\nU2" in text and text.endswith("<|assistant|>\n<think></think>\nA2")


def test_glm45_reasoning_only_after_last_user(tok):
    msgs = [
        user("U1"),
        asst("A1", reasoning_content="R1"),
        user("U2"),
        asst("<think>R2</think>A2"),
    ]
    text = render(tok("glm45"), msgs)
    assert "R1" not in text and "<|assistant|>\n<think></think>\nA1" in text
    assert text.endswith("<|assistant|>\n<think>R2</think>\nA2")


def test_glm45_enable_thinking_false(tok):
    msgs = [user("U1"), asst("A1"), user("U2")]
    text = render(tok("glm45"), msgs, add_generation_prompt=True, enable_thinking=False)
    assert "U1/nothink<|assistant|>" in text
    assert text.endswith("U2/nothink<|assistant|>\n<think></think>")
    assert render(tok("glm45"), msgs, add_generation_prompt=True).endswith("U2<|assistant|>")


def test_glm45_tool_calls_and_results(tok):
    msgs = [
        user("U1"),
        asst(tool_calls=[call(arguments={"city": "P", "days": 2})]),
        result("T1"),
        result("T2"),
    ]
    text = render(tok("glm45"), msgs)
    assert (
        "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>P</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    ) in text
    assert text.count("<|observation|>") == 1
    assert text.endswith(
        "<|observation|>\n<tool_response>\nT1\n</tool_response>\n<tool_response>\nT2\n"
        "</tool_response>"
    )


def test_glm45_string_arguments_raise(tok):
    with pytest.raises(TemplateError):
        render(tok("glm45"), [user("U1"), asst(tool_calls=[call(arguments='{"city": "P"}')])])


# ------------------------------------------------------------------------------------------------
# Mistral Nemo


def test_mistral_broken_alternation_raises(tok):
    with pytest.raises(TemplateError):
        render(tok("mistral"), [user("U1"), user("U2")])
    with pytest.raises(TemplateError):
        render(tok("mistral"), [asst("A1"), user("U1")])


def test_mistral_tool_messages_skip_the_alternation_check(tok):
    msgs = [user("U1"), asst(tool_calls=[call(call_id="abcdefghi")]), result("T1", "abcdefghi")]
    text = render(tok("mistral"), [*msgs, asst("A1")])
    assert text.endswith(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]'
        '</s>[TOOL_RESULTS]{"content": T1, "call_id": "abcdefghi"}[/TOOL_RESULTS]A1</s>'
    )


def test_mistral_tool_call_id_must_be_nine_characters(tok):
    with pytest.raises(TemplateError):
        render(tok("mistral"), [user("U1"), asst(tool_calls=[call(call_id="call_1")])])


def test_mistral_tools_only_before_last_user(tok):
    msgs = [user("U1"), asst("A1"), user("U2")]
    text = render(tok("mistral"), msgs, tools=[WEATHER])
    assert text == (
        "<s>[INST]U1[/INST]A1</s>[AVAILABLE_TOOLS]"
        + json.dumps([WEATHER])
        + "[/AVAILABLE_TOOLS][INST]U2[/INST]"
    )


def test_mistral_system_only_on_a_last_user_message(tok):
    msgs = [{"role": "system", "content": "S1"}, user("U1"), asst("A1"), user("U2")]
    assert render(tok("mistral"), msgs).endswith("[INST]S1\n\nU2[/INST]")
    assert "S1" not in render(tok("mistral"), msgs[:3])


def test_mistral_has_no_generation_prompt(tok):
    msgs = [user("U1")]
    assert render(tok("mistral"), msgs, add_generation_prompt=True) == render(tok("mistral"), msgs)
    assert render(tok("mistral"), [user("U1"), asst("A1")]) == "<s>[INST]U1[/INST]A1</s>"
