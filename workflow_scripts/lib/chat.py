"""Chat conversations: reading both common formats, and tokenizing with an assistant-only mask.

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
from typing import IO, Any

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


def normalize(row: Any) -> list[dict[str, str]]:
    """Messages as [{'role', 'content'}] from 'messages' (role/content) or ShareGPT
    'conversations' (from/value)."""
    if not isinstance(row, dict):
        raise BadRow("malformed", "a row must be a JSON object")
    if "messages" in row:
        raw, role_key, text_key = row["messages"], "role", "content"
    elif "conversations" in row:
        raw, role_key, text_key = row["conversations"], "from", "value"
    else:
        raise BadRow("malformed", "row has neither 'messages' nor 'conversations'")
    if not isinstance(raw, list) or not raw:
        raise BadRow("empty_conversation", "the conversation has no messages")
    messages = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or role_key not in msg or text_key not in msg:
            raise BadRow("malformed", f"message {i} lacks '{role_key}' or '{text_key}'")
        role = ROLES.get(str(msg[role_key]).lower())
        if role is None:
            raise BadRow(
                "unknown_role",
                f"message {i} has role {msg[role_key]!r}; known: {', '.join(sorted(ROLES))}",
            )
        if not isinstance(msg[text_key], str):
            raise BadRow("malformed", f"message {i} content is not a string")
        messages.append({"role": role, "content": msg[text_key]})
    return messages


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_len: int) -> Tokenized:
    """Apply the chat template and mask exactly the assistant tokens (end-of-turn included)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
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
            prefix = tokenizer.apply_chat_template(
                messages[:i], tokenize=False, add_generation_prompt=True
            )
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
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
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
    with open(path, encoding="utf-8") as src:
        for line_no, line in enumerate(src, start=1):
            if not line.strip():
                continue
            rows_in += 1
            try:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise BadRow("malformed", f"not valid JSON ({exc.msg})") from None
                sample = tokenize_conversation(tokenizer, normalize(row), max_len)
                if not any(sample.loss_mask):
                    raise BadRow(
                        "no_assistant_tokens",
                        "no assistant tokens"
                        + (" left after truncation" if sample.truncated else ""),
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
