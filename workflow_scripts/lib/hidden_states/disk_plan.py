"""The extraction job's disk plan, made before the model loads: the exact bytes of every shard
still to write (the token count of every sample is known from the tokenized data, the layout from
``shards.shard_layout``), in the configured storage dtype and in each of the others, against the
free space where the shards go. Logged, recorded in the part manifest (and so in the manifest and
the report), and a stop with the key to change when the disk is short. Before the run, the
dry-run estimates the same bytes from prepare's counts (``estimate.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.hidden_states.extraction import MAX_LISTED
from workflow_scripts.lib.hidden_states.shard_plan import Plan
from workflow_scripts.lib.hidden_states.shards import TORCH_DTYPES, shard_layout

log = logging.getLogger("eagle3")

STORAGE_CHOICES = ("float32", "bfloat16", "float8_e4m3fn")


def disk_plan(plan: Plan) -> dict[str, Any]:
    """The exact bytes of this job's shards, in the plan's storage dtype and in each of the
    others: all of them, and those still to write."""
    by_storage, todo_sizes = {}, {}
    for storage in dict.fromkeys([plan.storage, *STORAGE_CHOICES]):
        sizes = [plan.shard_bytes(s, storage) for s in plan.shards]
        todo_sizes[storage] = [size for s, size in zip(plan.shards, sizes) if s.entry is None]
        by_storage[storage] = {"bytes": sum(sizes), "todo_bytes": sum(todo_sizes[storage])}
    tokens = sum(s.num_tokens for s in plan.shards)
    final_rows = sum(s.final_rows for s in plan.shards)
    # one final row's bytes as the layout stores it (its scale too, for float8)
    rows = shard_layout(
        1, 0, 0, len(plan.aux_ids), plan.hidden_size, TORCH_DTYPES[plan.storage], {}
    ).row_bytes
    final_row_bytes = rows["final_hidden_states"] + rows.get("final_scales", 0)
    return {
        "storage_dtype": plan.storage,
        "num_tokens": tokens,
        # the final state is stored only where the loss reads it (before assistant tokens)
        "final_rows": final_rows,
        "final_rows_saved_bytes": (tokens - final_rows) * final_row_bytes,
        "todo_shards": len(plan.todo),
        "todo_shard_bytes": todo_sizes[plan.storage],
        "by_storage_dtype": by_storage,
    }


def check_outputs(io, p, plan: Plan) -> dict[str, Any]:
    """Writable output places and enough free disk for what is left to compute; logs the disk
    plan (exact bytes of the shards still to write, per storage dtype) and returns it."""
    for directory, what in (
        (io.shard_dir, "shard directory"),
        (io.part.parent, "part manifest directory"),
    ):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-test-{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as exc:
            raise UserError(f"the {what} {directory} is not writable: {exc}") from None
    dp = disk_plan(plan)
    free = shutil.disk_usage(io.shard_dir).free
    dp["free_bytes"] = free
    todo = dp["by_storage_dtype"][plan.storage]["todo_bytes"]
    need = int(todo * p.disk_margin)
    tokens = max(dp["num_tokens"], 1)
    gib = 2**30
    sizes = dp["todo_shard_bytes"]
    log.info(
        "disk plan: %d shard(s) to write, %d byte(s) (%.3f GiB) exactly in %s, %s; %.1f bytes "
        "per token; %.3f GiB free in %s; %.3f GiB needed with extract.disk_margin %.2f: margin "
        "%.3f GiB",
        len(sizes),
        todo,
        todo / gib,
        plan.storage,
        f"{min(sizes)} to {max(sizes)} bytes each" if sizes else "none",
        dp["by_storage_dtype"][plan.storage]["bytes"] / tokens,
        free / gib,
        io.shard_dir,
        need / gib,
        p.disk_margin,
        (free - need) / gib,
    )
    for i, (shard, size) in enumerate(zip(plan.todo, sizes)):
        if i < MAX_LISTED:
            log.info(
                "  %s: %d samples, %d tokens, %d bytes",
                shard.path.name,
                len(shard.samples),
                shard.num_tokens,
                size,
            )
    others = ", ".join(
        f"{name} {v['todo_bytes'] / gib:.3f} GiB ({v['bytes'] / tokens:.1f} bytes per token)"
        for name, v in dp["by_storage_dtype"].items()
        if name != plan.storage
    )
    log.info("the same shards stored in other dtypes (extract.storage_dtype): %s", others)
    log.info(
        "final states stored at the %d of %d positions the loss reads: %.3f GiB saved",
        dp["final_rows"],
        dp["num_tokens"],
        dp["final_rows_saved_bytes"] / gib,
    )
    if need > free:
        smaller = [
            name
            for name, v in dp["by_storage_dtype"].items()
            if v["todo_bytes"] * p.disk_margin <= free
        ]
        hint = (
            f"set extract.storage_dtype to {' or '.join(smaller)} (fits), "
            if smaller
            else "extract.storage_dtype float8_e4m3fn would not fit either; "
        )
        raise UserError(
            f"{io.shard_dir}: {free / gib:.2f} GiB free, but the {len(sizes)} shard(s) still to "
            f"write take {todo / gib:.2f} GiB in {plan.storage} (x extract.disk_margin "
            f"{p.disk_margin}: {need / gib:.2f} GiB); {hint}free disk space, or use a "
            "results_dir on a larger disk"
        )
    return dp
