"""Chat rows as users bring them, read into one form: ``{"messages": [...]}`` (OpenAI style) or
ShareGPT ``{"conversations": [{"from", "value"}]}``, a row-level ``tools`` list, assistant
reasoning under any of its names (``reasoning_content``, ``reasoning``, ``thinking``) or inline as
``<think>...</think>`` in the content, assistant ``tool_calls`` (arguments as an object or a JSON
string), and tool results (role ``tool``, ``ipython`` or ``function``, with ``tool_call_id`` and
``name``). Unknown fields are ignored; unknown roles are bad rows. Where a message holds different
reasoning texts under two names, the first of ``REASONING_KEYS`` is kept and the message counted
(``Conversation.reasoning_fields_disagree``).

A bad row is never a traceback: each kind is a ``BadRow`` with a reason that the stages count
(``on_bad_row: skip``) or report with file and line (``fail``): ``not_utf8``, ``malformed`` (not
JSON, not an object, no messages, a message without role or content, content not a string, a
tool call without a name or with arguments that are not a JSON object), ``unclosed_think`` (an
assistant content that opens a <think> block and never closes it: reasoning cut off, as at a
length limit), ``empty_conversation``, ``unknown_role``; and from the chat template
(``turns.py``): ``template_error`` and the reasons of a turn that cannot be supervised exactly as
generated.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.data.lines import (  # noqa: F401 (BadRow and the readers, re-exported)
    BAD_ROW,
    SOURCE,
    SOURCE_ROW,
    BadRow,
    origin,
    parse_line,
    read_lines,
)

log = logging.getLogger("eagle3")
MAX_LOGGED_SKIPS = 20  # bad rows logged one by one; the rest are only counted

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "ipython": "tool",
    "function": "tool",
}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # in precedence order
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def skip_or_fail(counts: Counter, bad: BadRow, where: str, on_bad_row: str, setting: str) -> None:
    """A bad row at ``where`` (file:line): a UserError naming ``setting`` (the config key of the
    policy) when ``on_bad_row`` is fail, else counted by reason and logged (the first few)."""
    if on_bad_row == "fail":
        raise UserError(f"{where}: {bad} (set {setting}: skip to count and skip such rows)")
    counts[bad.reason] += 1
    if sum(counts.values()) <= MAX_LOGGED_SKIPS:
        log.warning("%s: skipped: %s", where, bad)


@dataclass
class Conversation:
    """A row in one form. ``messages``: dicts with ``role`` (system, user, assistant, tool) and
    ``content`` (a string); assistant messages may hold ``reasoning`` (a string) and
    ``tool_calls`` ([{"id", "name", "arguments" (an object), "arguments_text" (the JSON string
    as the row gave it, or None)}]); tool messages ``tool_call_id`` and ``name``.
    ``reasoning_fields_disagree``: the assistant messages whose reasoning fields held different
    texts (the first of REASONING_KEYS kept)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    row_id: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    reasoning_fields_disagree: list[int] = field(default_factory=list)

    def texts(self, i: int) -> dict[str, Any]:
        """What message ``i`` says that a supervised turn must contain: its reasoning, its
        answer and its tool calls' names."""
        msg = self.messages[i]
        return {
            "reasoning": (msg.get("reasoning") or "").strip(),
            "answer": msg["content"].strip(),
            "tool_names": [call["name"] for call in msg.get("tool_calls") or []],
        }


def normalize(row: Any) -> Conversation:
    """A JSONL row (already parsed) as a Conversation; a BadRow saying what is wrong."""
    if not isinstance(row, dict):
        raise BadRow("malformed", f"a row must be a JSON object, not {_kind(row)}")
    if isinstance(row.get(BAD_ROW), dict):  # a source row the data stage could not read
        raise BadRow(str(row[BAD_ROW].get("reason")), str(row[BAD_ROW].get("detail")))
    if "messages" in row:
        raw, role_key, text_key, key = row["messages"], "role", "content", "messages"
    elif "conversations" in row:
        raw, role_key, text_key, key = row["conversations"], "from", "value", "conversations"
    else:
        raise BadRow("malformed", "row has neither 'messages' nor 'conversations'")
    if not isinstance(raw, list):
        raise BadRow("malformed", f"'{key}' must be a list of messages, not {_kind(raw)}")
    if not raw:
        raise BadRow("empty_conversation", "the conversation has no messages")
    tools = row.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise BadRow("malformed", f"'tools' must be a list of objects, not {_kind(tools)}")
    messages = [_message(i, msg, role_key, text_key) for i, msg in enumerate(raw)]
    disagree = [
        i for i, msg in enumerate(messages) if msg["role"] == "assistant" and _disagree(raw[i])
    ]
    return Conversation(
        messages=messages,
        tools=tools or None,
        row_id=row.get("id"),
        reasoning_fields_disagree=disagree,
    )


def _message(i: int, msg: Any, role_key: str, text_key: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise BadRow("malformed", f"message {i} must be a JSON object, not {_kind(msg)}")
    if role_key not in msg:
        raise BadRow("malformed", f"message {i} lacks '{role_key}'")
    role = ROLES.get(str(msg[role_key]).lower())
    if role is None:
        raise BadRow(
            "unknown_role",
            f"message {i} has role {msg[role_key]!r}; known: {', '.join(sorted(ROLES))}",
        )
    calls = _tool_calls(i, msg.get("tool_calls")) if role == "assistant" else []
    content = msg.get(text_key)
    if content is None and not calls:
        raise BadRow("malformed", f"message {i} lacks '{text_key}'")
    if content is not None and not isinstance(content, str):
        raise BadRow("malformed", f"message {i} {text_key} is {_kind(content)}, not a string")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if role == "assistant":
        reasoning = _reasoning(i, msg)
        if out["content"].lstrip().startswith(THINK_OPEN) and THINK_CLOSE not in out["content"]:
            raise BadRow(
                "unclosed_think",
                f"message {i} opens a <think> block that its {text_key} never closes: the "
                "reasoning was cut off (as at a length limit) and no answer follows it; complete "
                "the turn, or drop the row",
            )
        if THINK_CLOSE in out["content"]:
            if reasoning is not None:
                raise BadRow(
                    "malformed",
                    f"message {i} has both a reasoning field and <think> reasoning in its content",
                )
            inline, _, out["content"] = out["content"].rpartition(THINK_CLOSE)
            reasoning = inline.strip("\n").removeprefix(THINK_OPEN).strip("\n")
            out["content"] = out["content"].lstrip("\n")
        if reasoning is not None:
            out["reasoning"] = reasoning
        if calls:
            out["tool_calls"] = calls
    elif role == "tool":
        for name in ("tool_call_id", "name"):
            if isinstance(msg.get(name), str):
                out[name] = msg[name]
    return out


def _reasoning(i: int, msg: dict) -> str | None:
    """The reasoning of message ``i``: the first of REASONING_KEYS that is set."""
    found = [msg[k] for k in REASONING_KEYS if msg.get(k) not in (None, "")]
    if not found:
        return None
    if not all(isinstance(r, str) for r in found):
        raise BadRow("malformed", f"message {i} has reasoning that is not a string")
    return found[0]


def _disagree(msg: dict) -> bool:
    """Whether two reasoning fields of ``msg`` hold different texts (whitespace around aside)."""
    return len({msg[k].strip() for k in REASONING_KEYS if msg.get(k) not in (None, "")}) > 1


def _tool_calls(i: int, raw: Any) -> list[dict[str, Any]]:
    if raw in (None, []):
        return []
    if not isinstance(raw, list):
        raise BadRow("malformed", f"message {i} tool_calls must be a list, not {_kind(raw)}")
    calls = []
    for k, call in enumerate(raw):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRow("malformed", f"message {i} tool call {k} has no function name")
        args, text = fn.get("arguments", {}), None
        if isinstance(args, str):
            text = args
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise BadRow(
                    "malformed", f"message {i} tool call {k} arguments are not valid JSON"
                ) from None
        if not isinstance(args, dict):
            raise BadRow("malformed", f"message {i} tool call {k} arguments must be a JSON object")
        call_id = call.get("id") if isinstance(call, dict) else None
        calls.append(
            {
                "id": call_id if isinstance(call_id, str) else None,
                "name": fn["name"],
                "arguments": args,
                "arguments_text": text,
            }
        )
    return calls


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else "a value")


def row_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A message in a Conversation's form as a JSONL row carries it (what ``normalize`` reads
    back): reasoning as ``reasoning_content``, tool calls in OpenAI form with their arguments as
    the row gave them."""
    out = {k: v for k, v in msg.items() if k not in ("reasoning", "tool_calls")}
    if msg.get("reasoning") is not None:
        out["reasoning_content"] = msg["reasoning"]
    if msg.get("tool_calls"):
        out["tool_calls"] = [
            {
                **({"id": c["id"]} if c.get("id") is not None else {}),
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": (
                        c["arguments_text"]
                        if c.get("arguments_text") is not None
                        else c["arguments"]
                    ),
                },
            }
            for c in msg["tool_calls"]
        ]
    return out
