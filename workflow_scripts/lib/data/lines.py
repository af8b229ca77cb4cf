"""A row as read from where users keep it, before anything knows it is a conversation: JSON Lines
parsed one line at a time, ``BadRow``, the one kind of error a row can be (counted by its
``reason`` under an ``on_bad_row: skip`` policy, or reported with where it is), and where a row of
the data stage's file came from (``source_row``; ``bad_row`` for a source row it could not read,
which the stage reading the file counts or reports under its own policy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

SOURCE = "source"  # in the data stage's file: the name of the source a row came from
SOURCE_ROW = "source_row"  # in the data stage's file: the file (or dataset) and row it came from
BAD_ROW = "bad_row"  # in the data stage's file: a source row that could not be read, and why


class BadRow(ValueError):
    """A row that cannot be used; ``reason`` is a short key counted in the stats."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def origin(row: Any, fallback: str) -> str:
    """Where a row came from: the source and row the data stage recorded with it, else
    ``fallback`` (the file and line it was read at)."""
    if isinstance(row, dict) and isinstance(row.get(SOURCE_ROW), str):
        return row[SOURCE_ROW]
    return fallback


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
