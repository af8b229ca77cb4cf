"""Chat conversations: reading JSONL rows of both common formats, naming every bad row, and
tokenizing with an assistant-only mask.

A bad row is never a traceback: each kind is a ``BadRow`` with a reason that the stages count
(``on_bad_row: skip``) or report with file and line (``fail``): ``not_utf8``, ``malformed`` (not
JSON, not an object, no messages, a message without role or content, content not a string),
``empty_conversation``, ``unknown_role``, ``template_error`` (the chat template refused it),
``template_mismatch`` (the template changed a message's text).

The mask is computed from the rendered text: each assistant message's content is located in the
chat template's output, and the tokens that start inside it are masked, plus the special token
that closes the turn (``<|eot_id|>``, ``<|im_end|>``, ...). Template text (headers, role names,
the newline after an end-of-turn token) is never masked.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from workflow_scripts.lib.common import Progress, UserError

log = logging.getLogger("eagle3")
MAX_LOGGED_SKIPS = 20  # bad rows logged one by one; the rest are only counted

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
}


class BadRow(ValueError):
    """A conversation that cannot be used; ``reason`` is a short key counted in the stats."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def skip_or_fail(counts: Counter, bad: BadRow, where: str, on_bad_row: str, setting: str) -> None:
    """A bad row at ``where`` (file:line): a UserError naming ``setting`` (the config key of the
    policy) when ``on_bad_row`` is fail, else counted by reason and logged (the first few)."""
    if on_bad_row == "fail":
        raise UserError(f"{where}: {bad} (set {setting}: skip to count and skip such rows)")
    counts[bad.reason] += 1
    if sum(counts.values()) <= MAX_LOGGED_SKIPS:
        log.warning("%s: skipped: %s", where, bad)


def read_lines(path: Path | str) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line of a JSONL file, streamed."""
    with open(path, "rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            if line.strip():
                yield line_no, line


def parse_line(raw: bytes) -> Any:
    """One JSONL line -> its JSON value; a BadRow if it is not UTF-8 or not JSON. A byte-order
    mark before the first row is allowed."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRow(
            "not_utf8", f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
        ) from None
    try:
        return json.loads(text.removeprefix("\ufeff"))
    except json.JSONDecodeError as exc:
        raise BadRow("malformed", f"not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise BadRow("malformed", "not valid JSON (nested too deeply)") from None


def normalize(row: Any) -> list[dict[str, str]]:
    """Messages as [{'role', 'content'}] from 'messages' (role/content) or ShareGPT
    'conversations' (from/value)."""
    if not isinstance(row, dict):
        raise BadRow("malformed", f"a row must be a JSON object, not {_kind(row)}")
    if "messages" in row:
        raw, role_key, text_key = row["messages"], "role", "content"
    elif "conversations" in row:
        raw, role_key, text_key = row["conversations"], "from", "value"
    else:
        raise BadRow("malformed", "row has neither 'messages' nor 'conversations'")
    key = "messages" if role_key == "role" else "conversations"
    if not isinstance(raw, list):
        raise BadRow("malformed", f"'{key}' must be a list of messages, not {_kind(raw)}")
    if not raw:
        raise BadRow("empty_conversation", "the conversation has no messages")
    messages = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise BadRow("malformed", f"message {i} must be a JSON object, not {_kind(msg)}")
        if role_key not in msg or text_key not in msg:
            raise BadRow("malformed", f"message {i} lacks '{role_key}' or '{text_key}'")
        role = ROLES.get(str(msg[role_key]).lower())
        if role is None:
            raise BadRow(
                "unknown_role",
                f"message {i} has role {msg[role_key]!r}; known: {', '.join(sorted(ROLES))}",
            )
        if not isinstance(msg[text_key], str):
            raise BadRow(
                "malformed", f"message {i} {text_key} is {_kind(msg[text_key])}, not a string"
            )
        messages.append({"role": role, "content": msg[text_key]})
    return messages


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else "a value")


def render(tokenizer, messages: list[dict[str, str]], **kwargs) -> str:
    """The chat template applied to ``messages``; a BadRow if the template refuses them (many
    templates raise on roles out of order, for one)."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except (TemplateError, ValueError, TypeError) as exc:
        raise BadRow("template_error", f"the chat template refused it: {exc}") from None


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_len: int) -> Tokenized:
    """Apply the chat template and mask exactly the assistant tokens (end-of-turn included)."""
    text = render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    offsets: list[tuple[int, int]] = enc["offset_mapping"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))

    spans = []
    cursor = 0
    for i, msg in enumerate(messages):
        content = msg["content"].strip()
        if not content:
            continue
        if msg["role"] == "assistant":
            # Skip the template's own text for this turn (its header could repeat the content).
            prefix = render(tokenizer, messages[:i], add_generation_prompt=True)
            if text.startswith(prefix):
                cursor = max(cursor, len(prefix))
        start = text.find(content, cursor)
        if start < 0:
            raise BadRow(
                "template_mismatch",
                "the chat template changed a message's text; cannot locate it to build the mask",
            )
        cursor = start + len(content)
        if msg["role"] == "assistant":
            spans.append((start, cursor))

    mask = [0] * len(ids)
    tok = 0
    for start, end in spans:
        while tok < len(ids) and offsets[tok][0] < start:
            tok += 1
        while tok < len(ids) and offsets[tok][0] < end and offsets[tok][1] > offsets[tok][0]:
            mask[tok] = 1
            tok += 1
        if tok < len(ids) and ids[tok] in special:  # the end-of-turn token
            mask[tok] = 1
            tok += 1

    truncated = len(ids) > max_len
    return Tokenized(ids[:max_len], mask[:max_len], truncated)


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of ``messages`` with the chat template's generation prompt after them,
    tokenized as prepare tokenizes whole conversations (the rendered text, no added tokens)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the special token the chat template puts right
    after an assistant message (``<|eot_id|>``, ``<|im_end|>``, ...) and the tokenizer's eos."""
    marker = "Zq9 marker"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = set()
    after = text[text.rfind(marker) + len(marker) :]
    enc = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    for tok in enc:
        if tok in special:
            ids.add(tok)
            break
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def tokenize_chat_file(
    path: Path, tokenizer, max_len: int, on_bad_row: str, out: IO[str], progress: Progress
) -> dict[str, Any]:
    """Streams the chat data at ``path`` into ``out`` as tokenized rows ``{"id", "input_ids",
    "loss_mask"}`` (prepare's output); bad rows fail or are counted (``prepare.on_bad_row``),
    rows left with no assistant token are always dropped and counted. Returns the counts."""
    drops: Counter[str] = Counter()
    rows_in = rows_out = tokens = masked = truncated = 0
    for line_no, line in read_lines(path):
        rows_in += 1
        try:
            row = parse_line(line)
            sample = tokenize_conversation(tokenizer, normalize(row), max_len)
            if not any(sample.loss_mask):
                raise BadRow(
                    "no_assistant_tokens",
                    "no assistant tokens" + (" left after truncation" if sample.truncated else ""),
                )
        except BadRow as bad:
            policy = "skip" if bad.reason == "no_assistant_tokens" else on_bad_row
            skip_or_fail(drops, bad, f"{path}:{line_no}", policy, "prepare.on_bad_row")
            progress.update(1)
            continue
        row_id = row.get("id", f"line{line_no}")
        out.write(
            json.dumps(
                {"id": row_id, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask},
                separators=(",", ":"),
            )
            + "\n"
        )
        rows_out += 1
        tokens += len(sample.input_ids)
        masked += sum(sample.loss_mask)
        truncated += sample.truncated
        progress.update(1, len(sample.input_ids))
    return {
        "rows_in": rows_in,
        "rows_out": rows_out,
        "tokens": tokens,
        "loss_masked_tokens": masked,
        "truncated_rows": truncated,
        "dropped": dict(sorted(drops.items())),
    }
