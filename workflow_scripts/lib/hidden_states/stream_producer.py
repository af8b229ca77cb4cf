"""Hidden states within a disk budget (``extract.disk_budget``): the engine's side.

Training's job (``lib/training/stream_consumer.py``) decides the order in which it reads the shards and
which of them stay on disk, and writes it to ``schedule.json`` in the stream directory before it
starts the engine: the held-out shards (the validation split's samples, computed first and kept),
then every shard occurrence still to compute, in the order of the step that first reads it. This
module computes them in that order with the extraction's own engine, connector, storage dtype and
checks (``extract_engines.extract``), each one only once its file is gone (training removes a shard after
the last step that reads it) and only when it fits: the bytes of the files in the directory plus
its own exact size (the disk plan's) at most the budget. Training deletes, the engine waits; the
engine never deletes a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from workflow_scripts.lib.common import UserError, read_json
from workflow_scripts.lib.hidden_states.extract_engines import extract
from workflow_scripts.lib.hidden_states.extraction import make_plan
from workflow_scripts.lib.hidden_states.shard_plan import (
    Plan,
    ShardPlan,
    fingerprint,
    read_rows,
    sample_tensors,
    shard_key,
)
from workflow_scripts.lib.hidden_states.records import StreamPlan
from workflow_scripts.lib.hidden_states.shards import read_positions

log = logging.getLogger("eagle3")

SCHEDULE_FILE = "schedule.json"


def heldout_name(k: int) -> str:
    return f"heldout_{k:06d}.safetensors"


def stream_files(directory: Path) -> list[Path]:
    """The files that count against the budget: shards, held-out shards, their partial files."""
    return [
        p
        for p in directory.iterdir()
        if p.name.endswith(".safetensors") or ".safetensors.tmp-" in p.name
    ]


def used_bytes(directory: Path) -> int:
    total = 0
    for path in stream_files(directory):
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # removed meanwhile
            pass
    return total


def all_shards_plan(tokenized: Path, verifier: Path, shard_dir: Path, p) -> Plan:
    """The extraction plan of every shard (as one extraction job of one would make it)."""
    io = SimpleNamespace(
        tokenized=Path(tokenized), verifier=Path(verifier), shard_dir=Path(shard_dir), job_index=0
    )
    return make_plan(io, p.model_copy(update={"num_jobs": 1}))


def heldout_shard(
    plan: Plan,
    k: int,
    lines: list[int],
    lengths: list[int],
    final_rows: list[int],
    sources: list[str],
    directory: Path,
) -> ShardPlan:
    """Held-out shard k: the samples on tokenized lines ``lines`` (with their lengths and stored
    final rows), fingerprinted by them and by ``sources``, the fingerprint of the shard each of
    them comes from (which holds its bytes)."""
    shard = ShardPlan(
        -1 - k,
        min(lines),
        max(lines) + 1,
        list(lines),
        list(lengths),
        [],
        directory / heldout_name(k),
    )
    shard.sample_final_rows = list(final_rows)
    shard.final_rows = sum(final_rows)
    shard.rows_sha256 = hashlib.sha256("\n".join(dict.fromkeys(sources)).encode()).hexdigest()
    key = {**shard_key(plan.key, plan.storage), "samples": list(lines)}
    shard.fingerprint = fingerprint(key, shard)
    return shard


def read_heldout_shard(plan: Plan, k: int, lines: list[int], tokenized: Path, directory: Path):
    """``heldout_shard`` with the lengths and final rows read from the tokenized data."""
    vocab = int(plan.cfg["vocab_size"])
    size = int(plan.common["shard_size_samples"])
    by_index = {s.index: s for s in plan.shards}
    lengths, final_rows, sources = [], [], []
    for i, row in read_rows(tokenized, plan.line_offsets, lines):
        ids, mask = sample_tensors(tokenized, i, row, vocab)
        lengths.append(int(ids.numel()))
        final_rows.append(len(read_positions(mask)))
        sources.append(by_index[i // size].fingerprint)
    return heldout_shard(plan, k, lines, lengths, final_rows, sources, directory)


def plan_of(stream_plan_: StreamPlan) -> Plan:
    """The extraction plan's settings as the stream plan records them (no shards, no data): what
    sizes and fingerprints of held-out shards need."""
    c = stream_plan_
    cfg = {
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
    }
    return Plan(
        Path(c.verifier.path),
        cfg,
        list(c.aux_layer_ids),
        c.dtype,
        c.storage_dtype,
        {},
        c.key,
        None,
        c.num_samples,
    )


def stream_plan(plan: Plan, shard_dir: Path) -> StreamPlan:
    """What training needs to plan without any state on disk (the extract_plan stage's output):
    every shard's samples (tokenized lines), their lengths, its exact bytes and fingerprint."""
    shards = []
    for s in plan.shards:
        if not s.samples:
            continue
        shards.append(
            {
                "index": s.index,
                "file": os.path.relpath(s.path, shard_dir),
                "samples": s.samples,
                "lengths": s.lengths,
                "final_rows": s.sample_final_rows,
                "num_tokens": s.num_tokens,
                "bytes": plan.shard_bytes(s),
                "fingerprint": s.fingerprint,
            }
        )
    skipped = sorted(i for s in plan.shards for i in s.skipped)
    return StreamPlan(
        **plan.common,
        kind="stream_plan",
        key=plan.key,
        num_samples=sum(len(s["samples"]) for s in shards),
        num_tokens=sum(s["num_tokens"] for s in shards),
        num_skipped_too_long=len(skipped),
        skipped_too_long=skipped,
        bytes=sum(s["bytes"] for s in shards),
        shards=shards,
    )


def produce(io, p) -> None:
    """The engine's run: the schedule's shards, in order, each when it fits (see the module)."""
    schedule = read_json(io.shard_dir / SCHEDULE_FILE)
    budget = int(schedule["budget_bytes"])
    plan = all_shards_plan(io.tokenized, io.verifier, io.shard_dir, p)
    by_index = {s.index: s for s in plan.shards}
    todo: list[ShardPlan] = [
        read_heldout_shard(plan, k, lines, io.tokenized, io.shard_dir)
        for k, lines in enumerate(schedule["heldout"])
    ]
    todo += [by_index[i] for i in schedule["order"]]
    for shard in todo:
        if shard.fingerprint != schedule["fingerprints"].get(shard.path.name, shard.fingerprint):
            raise UserError(
                f"{shard.path.name}: the schedule was planned from other data or settings than "
                f"{io.tokenized} and the extract settings give; rerun the train job"
            )
    sizes = {s.path.name: plan.shard_bytes(s) for s in todo}
    # the first occurrences already on disk (training checked them) are not computed again
    present, kept = set(schedule["present"]), []
    for shard in todo:
        if shard.path.name in present and shard.path.exists():
            present.discard(shard.path.name)
            continue
        kept.append(shard)
    todo = kept
    log.info(
        "engine for training: %d shard(s) to compute in training's order (%.3f GiB), within a "
        "disk budget of %.3f GiB in %s",
        len(todo),
        sum(sizes[s.path.name] for s in todo) / 2**30,
        budget / 2**30,
        io.shard_dir,
    )

    def ready(shard: ShardPlan) -> bool:
        """Its previous copy removed by training, and room for it within the budget."""
        if shard.path.exists() or any(shard.path.parent.glob(f".{shard.path.name}.tmp-*")):
            return False
        return used_bytes(io.shard_dir) + sizes[shard.path.name] <= budget

    shard_io = SimpleNamespace(
        tokenized=io.tokenized, verifier=io.verifier, shard_dir=io.shard_dir, job_index=0
    )
    for shard in todo:
        shard.entry = None
    extract(shard_io, p, plan, shards=todo, ready=ready, label="engine for training")


def write_schedule(directory: Path, schedule: dict[str, Any]) -> None:
    tmp = directory / (SCHEDULE_FILE + ".tmp-write")
    tmp.write_text(json.dumps(schedule))
    os.replace(tmp, directory / SCHEDULE_FILE)
