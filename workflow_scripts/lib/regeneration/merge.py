"""The merge of regeneration's jobs (``regenerate_merge``): their parts checked against each other,
their batches written in input order as one chat dataset, and the statistics. No torch, no vLLM:
a small CPU job.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from workflow_scripts.lib.common import UserError, atomic_path, read_json
from workflow_scripts.lib.regeneration.answers import batch_path, load_batch

RERUN_HINT = "rerun the jobs with: snakemake --forcerun regenerate <target>"
SHARED = ("fingerprint", "chat_data", "verifier", "num_jobs", "num_batches", "rows_in", "bad_rows")


def check_parts(parts: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    if not parts:
        raise UserError("no regenerate parts to merge")
    first_path, first = parts[0]
    for path, part in parts[1:]:
        differ = [k for k in SHARED if part.get(k) != first.get(k)]
        if differ:
            raise UserError(
                f"{path} and {first_path} disagree on {', '.join(differ)}: they come from "
                f"different runs; {RERUN_HINT}"
            )
    if first["num_jobs"] != len(parts):
        raise UserError(f"{len(parts)} parts for num_jobs {first['num_jobs']}; {RERUN_HINT}")
    owners = Counter(b for _, part in parts for b in part["batches"])
    if sorted(owners) != list(range(first["num_batches"])) or any(n != 1 for n in owners.values()):
        raise UserError(f"the parts do not cover batches 0..{first['num_batches'] - 1} once each")
    return first


def merge(io) -> dict[str, Any]:
    """Writes the regenerated chat data (``io.regenerated``) in input order; returns the stats."""
    parts = [(path, read_json(path)) for path in io.parts]
    first = check_parts(parts)
    stats: Counter = Counter()
    bad: Counter = Counter(first["bad_rows"])
    with atomic_path(io.regenerated) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for b in range(first["num_batches"]):
            path = batch_path(io.work_dir, b)
            batch = load_batch(path, first["fingerprint"])
            if batch is None:
                raise UserError(f"{path}: missing, cut short or from another run; {RERUN_HINT}")
            for row in batch["rows"]:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
            stats.update(batch["stats"])
            bad.update(batch["bad"])
        if stats["rows_out"] == 0:
            raise UserError(
                f"{first['chat_data']}: no conversation left after regeneration among "
                f"{first['rows_in']} rows (bad rows: {dict(bad) or 'none'}, dropped at the length "
                f"limit: {stats['dropped_length_limited']})"
            )
    return {
        "chat_data": first["chat_data"],
        "verifier": first["verifier"],
        "rows_in": first["rows_in"],
        "rows_out": stats["rows_out"],
        "bad_rows": dict(sorted(bad.items())),
        "turns": stats["turns"],
        "reasoning_turns": stats["reasoning_turns"],
        "empty_answers": stats["empty_answers"],
        "length_limited_turns": stats["length_limited_turns"],
        "length_limited_conversations": stats["length_limited_conversations"],
        "dropped_length_limited": stats["dropped_length_limited"],
        "context_full_conversations": stats["context_full_conversations"],
        "prompt_tokens": stats["prompt_tokens"],
        "generated_tokens": stats["generated_tokens"],
        "batches": first["num_batches"],
        "batches_reused": sum(part["batches_reused"] for _, part in parts),
        "jobs": first["num_jobs"],
        "job_seconds": [part["seconds"] for _, part in parts],
        "params": first["params"],
    }
