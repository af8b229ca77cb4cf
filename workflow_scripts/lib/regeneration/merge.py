"""The merge of regeneration's jobs (``regenerate_merge``): their parts checked against each other,
their batches written in input order as one chat dataset, and the statistics. No torch, no vLLM:
a small CPU job.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from workflow_scripts.lib.common import UserError, atomic_path
from workflow_scripts.lib.regeneration.answers import batch_path, load_batch
from workflow_scripts.lib.regeneration.records import AnswerCounts, RegeneratePart
from workflow_scripts.lib.workflow.jobs import check_parts
from workflow_scripts.lib.workflow.records import RegenerateStats
from workflow_scripts.lib.workflow.registry import RegenerateMergeIO

RERUN_HINT = "rerun the jobs with: snakemake --forcerun regenerate <target>"
# what every job's part must agree on: they come from one run
SHARED = (
    "input_sha256", "batch_keys", "chat_data", "verifier", "num_jobs", "num_batches", "rows_in",
    "bad_rows",
)  # fmt: skip


def read_parts(paths: list[Path]) -> list[RegeneratePart]:
    """The jobs' parts, checked: one run, one part per job, every batch in exactly one."""
    if not paths:
        raise UserError("no regenerate parts to merge")
    parts = [RegeneratePart.read(path) for path in paths]
    first = parts[0]
    for path, part in zip(paths[1:], parts[1:]):
        differ = [k for k in SHARED if getattr(part, k) != getattr(first, k)]
        if differ:
            raise UserError(
                f"{path} and {paths[0]} disagree on {', '.join(differ)}: they come from "
                f"different runs; {RERUN_HINT}"
            )
    check_parts(
        [part.job_index for part in parts],
        [part.batches for part in parts],
        first.num_jobs,
        first.num_batches,
        "batches",
        RERUN_HINT,
    )
    return parts


def merge(io: RegenerateMergeIO) -> RegenerateStats:
    """Writes the regenerated chat data (``io.regenerated``) in input order; returns the stats."""
    parts = read_parts(io.parts)
    first = parts[0]
    counts = AnswerCounts()
    bad: Counter = Counter(first.bad_rows)
    with atomic_path(io.regenerated) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for b in range(first.num_batches):
            path = batch_path(io.work_dir, b)
            batch = load_batch(path, first.batch_keys[b])
            if batch is None:
                raise UserError(f"{path}: missing, cut short or from another run; {RERUN_HINT}")
            for row in batch.rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
            counts += batch.stats
            bad.update(batch.bad)
        if counts.rows_out == 0:
            raise UserError(
                f"{first.chat_data}: no conversation left after regeneration among "
                f"{first.rows_in} rows (bad rows: {dict(bad) or 'none'}, dropped at the length "
                f"limit: {counts.dropped_length_limited})"
            )
    return RegenerateStats(
        chat_data=first.chat_data,
        verifier=first.verifier,
        rows_in=first.rows_in,
        bad_rows=dict(sorted(bad.items())),
        **counts.model_dump(),
        batches=first.num_batches,
        batches_reused=sum(part.batches_reused for part in parts),
        jobs=first.num_jobs,
        job_seconds=[part.seconds for part in parts],
        params=first.params,
        made_by=first.made_by,
    )
