"""The chat data of every source in one JSON Lines file: how many rows each source gives, which
rows (sampled with a seed), and each written in the form the chat stages read, naming where it
came from.

How many rows: a source with ``rows`` gives exactly that many; the sources with ``weight`` share
the rest in proportion to their weights (``data.num_rows`` in all, or, when that is null, as
many as the weights allow without repeating a row: the scarcest source relative to its weight
gives all of its rows); a source with neither gives all of its rows. Which rows: for source i a
sample without replacement drawn from ``numpy.random.default_rng([seed, i])``, kept in the
source's order. Sources follow each other in config order.

Each output row is the source's row in chat form plus ``source`` (the source's name) and
``source_row`` (``file:row`` or ``owner/name/split:row``); a row that cannot be read is written as
``{"source", "source_row", "bad_row": {"reason", "detail"}}`` so that the stage reading the file
counts or reports it under its own ``on_bad_row``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import IO, Any

import numpy as np

from workflow_scripts.lib.common import Progress, UserError
from workflow_scripts.lib.data.layouts import chat_layout, chat_row
from workflow_scripts.lib.data.readers import columns, count_rows, iter_rows
from workflow_scripts.lib.data.lines import BAD_ROW, SOURCE, SOURCE_ROW, BadRow
from workflow_scripts.lib.workflow.sources import ChatSource


def plan_counts(sources: list[ChatSource], available: list[int], num_rows: int | None) -> list[int]:
    """Rows taken from each source (see the module's docstring)."""
    counts = [s.rows if s.rows is not None else n for s, n in zip(sources, available)]
    for s, n, want in zip(sources, available, counts):
        if want > n:
            raise UserError(
                f"source '{s.label}' has {n} rows, fewer than the {want} its 'rows' asks for"
            )
    weighted = [i for i, s in enumerate(sources) if s.weight is not None]
    if not weighted:
        if num_rows is not None:
            raise UserError(
                "data.num_rows is set, but no source has a 'weight' to share it: give the "
                "sources weights, or set data.num_rows: null"
            )
        return counts
    total_weight = sum(sources[i].weight for i in weighted)
    if num_rows is None:
        share = min(available[i] * total_weight / sources[i].weight for i in weighted)
        to_share = int(math.floor(share + 1e-9))
    else:
        fixed = sum(c for i, c in enumerate(counts) if i not in weighted)
        to_share = num_rows - fixed
        if to_share < 0:
            raise UserError(
                f"data.num_rows {num_rows} is less than the {fixed} rows the sources with "
                "'rows' (or neither 'rows' nor 'weight': all their rows) take"
            )
    exact = {i: to_share * sources[i].weight / total_weight for i in weighted}
    taken = {i: int(math.floor(x)) for i, x in exact.items()}
    # the rows left by rounding down go to the largest remainders (ties: config order)
    left = to_share - sum(taken.values())
    for i in sorted(weighted, key=lambda i: (-(exact[i] - taken[i]), i))[:left]:
        taken[i] += 1
    for i in weighted:
        if taken[i] > available[i]:
            raise UserError(
                f"source '{sources[i].label}' has {available[i]} rows, fewer than the "
                f"{taken[i]} its weight asks for of data.num_rows {num_rows}: lower "
                "data.num_rows or its weight"
            )
        counts[i] = taken[i]
    return counts


def sample(available: int, count: int, seed: int, index: int) -> set[int] | None:
    """The positions (from 0) of the rows taken from source ``index``; None: every row."""
    if count >= available:
        return None
    rng = np.random.default_rng([seed, index])
    return set(rng.choice(available, size=count, replace=False).tolist())


def mix(
    sources: list[ChatSource],
    files: list[list[Path]],
    seed: int,
    num_rows: int | None,
    out: IO[str],
    progress: Progress,
) -> dict[str, Any]:
    """Writes the mixture to ``out``; returns its statistics per source. Sources are counted
    (a pass over a JSON Lines file) only where rows are sampled."""
    shares = [s.rows is not None or s.weight is not None for s in sources]
    sampled = num_rows is not None or any(shares)
    available = [count_rows(s, f) for s, f in zip(sources, files)] if sampled else None
    counts = plan_counts(sources, available, num_rows) if sampled else None
    per_source = []
    for index, (source, paths) in enumerate(zip(sources, files)):
        layout, pair = chat_layout(
            source.layout,
            columns(source, paths),
            source.label,
            (source.prompt_column, source.response_column),
        )
        keep = sample(available[index], counts[index], seed, index) if sampled else None
        unreadable: Counter[str] = Counter()
        written = 0
        for position, (where, row) in enumerate(iter_rows(source, paths)):
            if keep is not None and position not in keep:
                continue
            try:
                if isinstance(row, BadRow):
                    raise row
                line = {**chat_row(row, layout, pair), SOURCE: source.label, SOURCE_ROW: where}
            except BadRow as bad:
                unreadable[bad.reason] += 1
                why = {"reason": bad.reason, "detail": str(bad)}
                line = {SOURCE: source.label, SOURCE_ROW: where, BAD_ROW: why}
            out.write(json.dumps(line, ensure_ascii=False, default=str) + "\n")
            written += 1
            progress.update(1)
        per_source.append(
            {
                "name": source.label,
                "source": source.model_dump(mode="json", exclude_none=True),
                "layout": layout if pair is None else f"{layout} ({pair[0]}, {pair[1]})",
                "rows_available": available[index] if sampled else written,
                "rows_taken": written,
                "rows_unreadable": dict(sorted(unreadable.items())),
            }
        )
    return {
        "rows": sum(s["rows_taken"] for s in per_source),
        "seed": seed,
        "num_rows": num_rows,
        "sources": per_source,
    }
