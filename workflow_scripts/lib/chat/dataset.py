"""A chat data file tokenized for training (prepare's output): each conversation's turns
(``turns.py``) in the fewest rows, streamed; bad conversations fail or are counted; the cost of
exactness kept visible in the statistics (rows per conversation, supervised tokens by kind,
extracted tokens against the tokens the rows would hold with their shared prefixes once).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from workflow_scripts.lib.chat.rows import (
    BadRow,
    Conversation,
    normalize,
    parse_line,
    read_lines,
    skip_or_fail,
)
from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.chat.turns import KINDS, Row, conversation_turns, pack_rows, unique_tokens
from workflow_scripts.lib.common import Progress

SETTING = "prepare.on_bad_row"
RECORDED = "regenerated_ids"  # on an assistant message: the ids regenerate served and sampled


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def read_conversation(row: Any) -> Conversation:
    """A parsed row as a Conversation, with the ids recorded by regeneration, if any."""
    conv = normalize(row)
    raw = row.get("messages") if isinstance(row, dict) else None
    for i, msg in enumerate(raw or []):
        ids = msg.get(RECORDED) if isinstance(msg, dict) else None
        if isinstance(ids, dict) and conv.messages[i]["role"] == "assistant":
            prompt, generated = ids.get("prompt"), ids.get("generated")
            if not (_ids(prompt) and _ids(generated)):
                raise BadRow("malformed", f"message {i} {RECORDED} are not lists of token ids")
            conv.extra.setdefault("turn_ids", {})[i] = (prompt, generated)
    return conv


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) for v in value)


def tokenize_rows(ct: ChatTemplate, conv: Conversation, max_len: int) -> tuple[list[Row], Counter]:
    """The rows of a conversation (cut to ``max_len`` tokens) and its supervised tokens by kind;
    a BadRow if no row keeps a supervised token."""
    turns = conversation_turns(ct, conv)
    if not turns:
        raise BadRow("no_assistant_tokens", "no assistant turn")
    kinds: Counter = Counter()
    for turn in turns:
        kinds.update(turn.kinds)
    rows = pack_rows(turns)
    if not any(1 in r.loss_mask[:max_len] for r in rows):
        raise BadRow("no_assistant_tokens", "no assistant tokens left after truncation")
    return rows, kinds


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> Tokenized:
    """One conversation of plain messages as one row (its template renders history stably,
    as the demo's does): input ids and loss mask, cut to ``max_len``."""
    rows, _ = tokenize_rows(ChatTemplate(tokenizer), Conversation(messages=messages), 1 << 30)
    if len(rows) != 1:
        raise BadRow("template_unstable", f"the conversation takes {len(rows)} rows, not one")
    ids, mask = rows[0].input_ids, rows[0].loss_mask
    return Tokenized(ids[:max_len], mask[:max_len], len(ids) > max_len)


def tokenize_chat_file(
    path: Path, ct: ChatTemplate, max_len: int, on_bad_row: str, out: IO[str], progress: Progress
) -> dict[str, Any]:
    """Streams the chat data at ``path`` into ``out`` as tokenized rows ``{"id", "input_ids",
    "loss_mask", "source_line"}`` (prepare's output); bad conversations fail or are counted
    (``prepare.on_bad_row``), those left with no supervised token are always dropped and
    counted. Returns the statistics."""
    drops: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    per_conversation: Counter[int] = Counter()
    rows_in = convs_out = rows_out = tokens = unique = masked = truncated = 0
    for line_no, line in read_lines(path):
        rows_in += 1
        try:
            row = parse_line(line)
            rows, conv_kinds = tokenize_rows(ct, read_conversation(row), max_len)
        except BadRow as bad:
            policy = "skip" if bad.reason == "no_assistant_tokens" else on_bad_row
            skip_or_fail(drops, bad, f"{path}:{line_no}", policy, SETTING)
            progress.update(1)
            continue
        row_id = row.get("id", f"line{line_no}")
        truncated += sum(len(r.input_ids) > max_len for r in rows)
        kept = [
            Row(r.input_ids[:max_len], r.loss_mask[:max_len], r.turns)
            for r in rows
            if 1 in r.loss_mask[:max_len]
        ]
        for k, r in enumerate(kept):
            out.write(
                json.dumps(
                    {
                        "id": row_id if len(kept) == 1 else f"{row_id}#{k}",
                        "input_ids": r.input_ids,
                        "loss_mask": r.loss_mask,
                        "source_line": line_no,
                    },
                    separators=(",", ":"),
                )
                + "\n"
            )
            tokens += len(r.input_ids)
            masked += sum(r.loss_mask)
        unique += unique_tokens(kept)
        convs_out += 1
        rows_out += len(kept)
        per_conversation[len(kept)] += 1
        kinds.update(conv_kinds)
        progress.update(1, sum(len(r.input_ids) for r in kept))
    return {
        "rows_in": rows_in,
        "conversations_out": convs_out,
        "rows_out": rows_out,
        "rows_per_conversation": {str(n): c for n, c in sorted(per_conversation.items())},
        "tokens": tokens,
        "unique_tokens": unique,
        "extracted_over_unique": round(tokens / unique, 4) if unique else None,
        "loss_masked_tokens": masked,
        # of every turn, before rows are cut to max_len
        "supervised_tokens_by_kind": {k: kinds.get(k, 0) for k in KINDS},
        "truncated_rows": truncated,
        "dropped": dict(sorted(drops.items())),
    }
