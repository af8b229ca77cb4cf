"""The verifier's chat template as it is served: rendered with the serving-time template arguments
(``chat_template.kwargs``: enable_thinking, thinking, reasoning_effort, date_string, ...) and a
fixed date for templates that print today's (``chat_template.date``), messages handed to it under
the names it reads, and what the template does that a loss mask must know, found by rendering
small probe conversations once:

* the form of tool-call arguments it takes (an object, or a JSON string: DeepSeek-V3.1);
* how it writes an assistant turn's reasoning where it keeps it (the text around it: Qwen3's
  ``<think>\\n...\\n</think>\\n\\n``, Kimi's ``<think>...</think>``, gpt-oss's analysis channel);
* the tokens that end a generation (the verifier's generation config, as vLLM stops), and the one
  that ends an assistant turn where the template writes none after it (GLM: the next role token);
* whether its generation prompt closes the <think> block, so that the verifier writes no
  reasoning (thinking off: DeepSeek-V3.1 by default, Qwen3 and GLM with ``enable_thinking:
  false``, Kimi-K2.5 with ``thinking: false``).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from workflow_scripts.lib.chat.rows import THINK_CLOSE, THINK_OPEN, BadRow

PROBE_REASONING = "Rzq probe reasoning"
PROBE_ANSWER = "Azq probe answer"
PROBE_USER = "Uzq probe question"
PROBE_CALL = {"id": "call00000", "name": "probe_fn", "arguments": {"probe_key": "probe_value"}}
PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_fn",
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {"probe_key": {"type": "string"}}},
        },
    }
]


@dataclass(frozen=True)
class ReasoningFormat:
    """How the template writes reasoning R in an assistant turn, after the generation prompt:
    ``before + open + R + close + after`` where the turn without reasoning reads ``before +
    after`` (``open``/``close`` are empty where the template writes an empty block)."""

    before: str
    open: str
    close: str
    after: str


def _call(call: dict[str, Any], form: str) -> dict[str, Any]:
    args: Any = call["arguments"]
    if form == "string":
        args = call.get("arguments_text") or json.dumps(call["arguments"], ensure_ascii=False)
    out = {"type": "function", "function": {"name": call["name"], "arguments": args}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stop_token_ids(tokenizer, verifier_dir: Path | str | None) -> list[int]:
    """The tokens that end a generation: the verifier's generation_config.json ``eos_token_id``
    (one id or a list; vLLM stops on each), config.json's, and the tokenizer's eos."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(verifier_dir) / name if verifier_dir is not None else None
        if path is None or not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            continue
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def load_template(verifier_dir: Path | str, settings) -> "ChatTemplate":
    """The verifier's chat template with ``settings`` (a ChatTemplateSettings: the config's
    ``chat_template``)."""
    from workflow_scripts.lib.verifier.files import load_tokenizer

    tokenizer = load_tokenizer(verifier_dir, settings.trust_remote_code)
    return ChatTemplate(tokenizer, settings.kwargs, settings.date, verifier_dir)


class ChatTemplate:
    """The verifier's tokenizer and chat template with the serving-time arguments."""

    def __init__(self, tokenizer, kwargs: dict[str, Any] | None = None, date: str | None = None,
                 verifier_dir: Path | str | None = None):  # fmt: skip
        self.tokenizer = tokenizer
        self.kwargs = dict(kwargs or {})
        if date is not None:
            day = dt.date.fromisoformat(date)
            self.kwargs["strftime_now"] = lambda fmt: day.strftime(fmt)
        self.stop_ids = stop_token_ids(tokenizer, verifier_dir or tokenizer.name_or_path or None)

    @cached_property
    def arguments_form(self) -> str | None:
        return self._probe_arguments()

    @cached_property
    def reasoning(self) -> ReasoningFormat | None:
        return self._probe_reasoning()

    @cached_property
    def next_role_stop(self) -> dict[str, int]:
        return self._probe_next_role_stops()

    @cached_property
    def thinking_off(self) -> bool:
        return self._probe_thinking_off()

    @cached_property
    def fresh_after(self) -> frozenset[int]:
        """The stop tokens after which this tokenizer starts afresh: a text that ends in one,
        followed by more, tokenizes as the two tokenized apart (fast tokenizers cut their input
        at added tokens first; a normalizer or pre-tokenizer that marks the start of its input,
        as SentencePiece's prefix space, breaks it). Probed on texts of every kind that follow
        a turn: newlines, spaces, words, another special token."""
        fresh = set()
        for stop in self.stop_ids:
            mark = self.decode([stop])
            if self.encode(mark) != [stop]:
                continue
            tails = ["\n", "\n\nUser: x", " x y", "x", "  \t x", mark + "x", "\n" + mark]
            heads = ["a b", "a b\n", ""]
            if all(
                self.encode(head + mark + tail) == self.encode(head + mark) + self.encode(tail)
                for head in heads
                for tail in tails
            ):
                fresh.add(stop)
        return frozenset(fresh)

    # ------------------------------------------------------------------ rendering

    def template_messages(
        self, messages: list[dict[str, Any]], form: str | None = None
    ) -> list[dict[str, Any]]:
        """Messages as templates read them: reasoning under each name some template reads,
        tool calls in OpenAI form with arguments in the form this template takes (``form``:
        'object' or 'string'; by default the one found by probing)."""
        out = []
        for msg in messages:
            m: dict[str, Any] = {"role": msg["role"], "content": msg["content"]}
            if msg.get("reasoning") is not None:
                for key in ("reasoning_content", "reasoning", "thinking"):
                    m[key] = msg["reasoning"]
            if msg.get("tool_calls"):
                form = form or self.arguments_form or "object"
                m["tool_calls"] = [_call(c, form) for c in msg["tool_calls"]]
            for key in ("tool_call_id", "name"):
                if msg.get(key) is not None:
                    m[key] = msg[key]
            out.append(m)
        return out

    def render(
        self,
        messages: list[dict[str, Any]],
        tools=None,
        generation_prompt=False,
        form=None,
        templated: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text for ``messages`` (canonical form, rows.py); a BadRow if the
        template refuses them (many raise on roles out of order, for one). ``templated``: the
        messages' ``template_messages`` already made (of these messages or more: the first
        len(messages) are taken)."""
        from jinja2 import TemplateError

        if templated is None or form is not None:
            templated = self.template_messages(messages, form)
        try:
            return self.tokenizer.apply_chat_template(
                templated[: len(messages)],
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.kwargs,
            )
        except (TemplateError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise BadRow("template_error", f"the chat template refused it: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def split_reasoning(self, prompt: str, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of ``text`` the verifier generated after ``prompt`` (the stop
        token left out): split where the template writes reasoning (``ReasoningFormat``), else
        at a <think> block; (None, text) where it wrote none."""
        fmt = self.reasoning
        if fmt is not None:
            start, end = fmt.before + fmt.open, fmt.close + fmt.after
            opened = text.startswith(start) if start else prompt.endswith(fmt.before)
            if opened and end and end in text[len(start) :]:
                at = text.index(end, len(start))
                return text[len(start) : at].strip(), text[at + len(end) :].strip()
        if THINK_CLOSE in text and (THINK_OPEN in text or prompt.rstrip().endswith(THINK_OPEN)):
            inner, _, answer = text.partition(THINK_CLOSE)
            return inner.split(THINK_OPEN)[-1].strip(), answer.strip()
        return None, text.strip()

    def answer_message(self, prompt: str, sampled: list[int]) -> dict[str, Any]:
        """The assistant message the verifier wrote with ``sampled`` (its generated ids, a final
        stop token left out) after ``prompt``: its answer, and its reasoning where it wrote
        some, as the next turn's history holds them."""
        body = sampled[:-1] if sampled and sampled[-1] in self.stop_ids else sampled
        reasoning, answer = self.split_reasoning(prompt, self.decode(body))
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        if reasoning is not None:
            message["reasoning"] = reasoning
        return message

    def prompt_ids(self, messages: list[dict[str, Any]], tools=None) -> list[int]:
        """The token ids the verifier is served for ``messages``: the template with its
        generation prompt, tokenized as rendered (no tokens added)."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    # ------------------------------------------------------------------ probes

    def _probe_arguments(self) -> str | None:
        """'object' or 'string': the form of tool-call arguments this template renders as the
        JSON they are (not double-encoded, not refused); None if it renders no tool calls."""
        for form in ("object", "string"):
            try:
                text = self.render(self._probe_chain(), PROBE_TOOLS, form=form)
            except BadRow:
                continue
            if "probe_key" in text and '\\"probe_key' not in text:
                return form
        return None

    def _probe_chain(self, reasoning: str | None = None, content: str = "") -> list[dict]:
        call = {**PROBE_CALL, "arguments_text": json.dumps(PROBE_CALL["arguments"])}
        turn = {"role": "assistant", "content": content, "tool_calls": [call]}
        if reasoning is not None:
            turn["reasoning"] = reasoning
        return [{"role": "user", "content": PROBE_USER}, turn]

    def _probe_reasoning(self) -> ReasoningFormat | None:
        """From renders of a last assistant turn with and without reasoning (a final answer,
        else a tool call with an answer beside it), the text around the reasoning; None where
        the template never renders it (DeepSeek's strip every turn's)."""
        user = [{"role": "user", "content": PROBE_USER}]
        answer = {"role": "assistant", "content": PROBE_ANSWER}
        probes = [(user + [{**answer, "reasoning": PROBE_REASONING}], user + [answer], None)]
        if self.arguments_form is not None:
            probes.append(
                (
                    self._probe_chain(PROBE_REASONING, PROBE_ANSWER),
                    self._probe_chain(None, PROBE_ANSWER),
                    PROBE_TOOLS,
                )
            )
        for with_r, without_r, tools in probes:
            try:
                prompt = self.render(user, tools, generation_prompt=True)
                a, b = self.render(with_r, tools), self.render(without_r, tools)
            except BadRow:
                continue
            at = a.find(PROBE_REASONING)
            end_b = b.find(PROBE_ANSWER, len(prompt))
            if at < 0 or end_b < 0 or not a.startswith(prompt) or not b.startswith(prompt):
                continue
            # a = prompt + before + open + R + close + after + A...; b = prompt + before + after + A...
            head = min(common_prefix(a, b), at)
            tail = min(common_prefix(a[::-1], b[::-1]), len(a) - at - len(PROBE_REASONING))
            tail = min(tail, len(b) - head)
            return ReasoningFormat(
                before=a[len(prompt) : head],
                open=a[head:at],
                close=a[at + len(PROBE_REASONING) : len(a) - tail],
                after=b[head:end_b],
            )
        return None

    def _probe_thinking_off(self) -> bool:
        """Whether the generation prompt after a user message ends with </think> (whitespace
        aside): the template closes the reasoning block, and the verifier writes none."""
        try:
            prompt = self.render([{"role": "user", "content": PROBE_USER}], generation_prompt=True)
        except BadRow:
            return False
        return prompt.rstrip().endswith(THINK_CLOSE)

    def _probe_next_role_stops(self) -> dict[str, int]:
        """For templates that write no end token after an assistant turn (GLM): the stop token
        between it and the message after it (the model generates it), by that message's role."""
        found: dict[str, int] = {}
        user = [{"role": "user", "content": PROBE_USER}]
        follow = {"user": ({"role": "user", "content": "Uzq next"}, PROBE_ANSWER, None)}
        if self.arguments_form is not None:
            result = {"role": "tool", "content": "Tzq result", "name": "probe_fn",
                      "tool_call_id": PROBE_CALL["id"]}  # fmt: skip
            follow["tool"] = (result, "probe_value", PROBE_TOOLS)
        for role, (nxt, mark, tools) in follow.items():
            turn = (
                self._probe_chain()[1]
                if role == "tool"
                else {"role": "assistant", "content": PROBE_ANSWER}
            )
            try:
                text = self.render(user + [turn, nxt], tools)
            except BadRow:
                continue
            at, end = text.find(mark), text.find(nxt["content"])
            if 0 <= at < end:
                stops = [t for t in self.encode(text[at + len(mark) : end]) if t in self.stop_ids]
                if stops:
                    found[role] = stops[0]
        return found
