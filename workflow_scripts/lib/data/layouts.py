"""How a source lays out its rows, chosen once per source from its columns (or stated in its
``layout``), and each row turned into the form the chat stages read: ``messages`` (OpenAI style)
or ``conversations`` (ShareGPT) with a row-level ``tools`` list, as the row gave them. A row that
does not fit its source's layout is a ``BadRow``; a source that fits none is a UserError naming
its columns.

Evaluation prompts get the same treatment with their own layouts: a conversation ending in a
user turn, one ``prompt`` text, or ``turns`` (user turns, each served after the verifier's own
answer to the one before, as MT-Bench is).
"""

from __future__ import annotations

from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.data.lines import BadRow

# (prompt, response) column pairs recognised by layout auto, in this order
PAIRS = (
    ("prompt", "response"),
    ("instruction", "response"),
    ("instruction", "output"),
    ("prompt", "completion"),
    ("question", "answer"),
    ("input", "output"),
)
ID_COLUMNS = ("id", "prompt_id", "question_id", "task_id", "conversation_id")
CHAT_KEYS = ("messages", "conversations", "tools")  # what a chat row keeps of its source's row


def chat_layout(
    stated: str, columns: list[str], label: str, pair: tuple[str, str] | None = None
) -> tuple[str, tuple[str, str] | None]:
    """The layout of a chat source (and its prompt/response columns: ``pair`` when stated),
    from its columns when ``stated`` is auto."""
    if stated == "prompt_response":
        return stated, pair
    if stated != "auto":
        if stated not in columns:
            raise UserError(
                f"source '{label}': layout {stated} needs a column '{stated}'; its columns are "
                f"{', '.join(columns) or 'none'}"
            )
        return stated, None
    for layout in ("messages", "conversations", "conversation"):
        if layout in columns:
            return layout, None
    for known in PAIRS:
        if set(known) <= set(columns):
            return "prompt_response", known
    raise UserError(
        f"source '{label}': no known layout fits its columns ({', '.join(columns) or 'none'}): "
        "a conversation in 'messages' (role/content), 'conversations' (from/value) or "
        "'conversation', or a prompt/response pair ("
        + ", ".join("/".join(p) for p in PAIRS)
        + "); set the source's layout: prompt_response with prompt_column and response_column"
    )


def row_id(row: dict[str, Any]) -> Any:
    for key in ID_COLUMNS:
        if row.get(key) is not None:
            return row[key]
    return None


def chat_row(row: Any, layout: str, pair: tuple[str, str] | None) -> dict[str, Any]:
    """A source row as a chat row (``messages`` or ``conversations``, ``tools``, ``id``)."""
    if not isinstance(row, dict):
        raise BadRow("malformed", f"a row must be a JSON object, not {type(row).__name__}")
    out: dict[str, Any] = {}
    if (rid := row_id(row)) is not None:
        out["id"] = rid
    if layout in ("messages", "conversations"):  # rows of either kind, as the chat stages read
        out.update({k: row[k] for k in CHAT_KEYS if row.get(k) is not None})
        if "messages" not in out and "conversations" not in out:
            raise BadRow("malformed", "row has neither 'messages' nor 'conversations'")
    elif layout == "conversation":
        out["messages"] = row.get("conversation")
        if row.get("tools") is not None:
            out["tools"] = row["tools"]
    else:
        prompt, response = (row.get(c) for c in pair)
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise BadRow(
                "malformed", f"columns {pair[0]} and {pair[1]} must both hold text in every row"
            )
        system = row.get("system")
        out["messages"] = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": response},
        ]
    return out


# --------------------------------------------------------------------------- prompts

# a set's layout; auto: each row's own (MT-Bench: FastChat's turns, or the hub copy's prompt list)
SET_LAYOUTS = {"humaneval": "prompt", "mt_bench": "auto", "gsm8k": "question", "demo": "auto"}


def prompt_layout(stated: str, set_name: str | None) -> str:
    """The layout of an evaluation set: stated, or the set's own; auto: each row's own."""
    if stated != "auto" or set_name is None:
        return stated
    return SET_LAYOUTS[set_name]


def _row_layout(row: dict[str, Any]) -> str:
    for layout in ("messages", "conversations", "turns", "prompt", "question"):
        if layout in row:
            return layout
    raise BadRow(
        "malformed",
        f"no prompt in the row's keys ({', '.join(map(str, row))}): give 'messages' or "
        "'conversations' ending in a user turn, 'prompt' (a text), 'turns' (user turns) or "
        "'question', or set the source's layout",
    )


def prompt_row(row: Any, layout: str) -> dict[str, Any]:
    """An evaluation row as ``{"id", "messages"}`` (a conversation ending in a user turn) or
    ``{"id", "turns"}`` (user turns, each served after the verifier's answer to the one before)."""
    if not isinstance(row, dict):
        raise BadRow("malformed", f"a row must be a JSON object, not {type(row).__name__}")
    if layout == "auto":
        layout = _row_layout(row)
    out: dict[str, Any] = {"id": row_id(row)}
    if layout in ("messages", "conversations"):
        if not isinstance(row.get(layout), list):
            raise BadRow("malformed", f"row has no list '{layout}'")
        out[layout] = row[layout]
        if row.get("tools") is not None:
            out["tools"] = row["tools"]
        return out
    value = row.get(layout)
    turns = value if isinstance(value, list) and layout in ("turns", "prompt") else [value]
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise BadRow("malformed", f"'{layout}' must hold text (a list of texts for turns)")
    out["turns"] = turns
    return out
