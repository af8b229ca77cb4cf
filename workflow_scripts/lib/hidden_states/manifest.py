"""The extraction manifest: what the extraction jobs' parts record, merged into the one file
that training depends on. No torch here: the merge job is small and starts fast.

A part (one per extraction job) and the manifest hold the layer ids and convention, the compute
and storage dtypes, the verifier's identity, the tokenized data's sha256, and one entry per shard:
file (relative to the part's or manifest's directory), sample range, sample and token counts,
bytes and sha256. Each part has its job's disk plan (``disk_plan.py``); the manifest's ``disk``
sums them: the bytes as stored and in each storage dtype, per token and against float32.
The shard format itself is described in ``shards.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from workflow_scripts.lib.common import UserError, sha256_file
from workflow_scripts.lib.workflow.jobs import check_parts
from workflow_scripts.lib.hidden_states.records import (
    FORMAT_VERSION,
    LAYER_CONVENTION,
    ExtractPart,
    Header,
    Manifest,
)

# Shards are no rule's output (so Snakemake never deletes them): a shard lost after extraction
# is recomputed by forcing the extraction jobs, which reuse every shard still in place.
RERUN_HINT = (
    "rerun extraction with `snakemake --forcerun extract <target>`: shards still in place "
    "are reused, only the missing ones are computed"
)


def shard_name(index: int) -> str:
    return f"shard_{index:06d}.safetensors"


def load_manifest(path: Path, verify_checksums: bool = False) -> Manifest:
    """Read a manifest, check every shard exists (and its checksum, if asked); each shard's
    ``path`` is set, absolute."""
    path = Path(path)
    manifest = Manifest.read(path)
    for entry in manifest.shards:
        shard = (path.parent / entry.file).resolve()
        entry.path = str(shard)
        if not shard.is_file():
            raise UserError(f"{path}: shard {shard} is missing; {RERUN_HINT}")
        if verify_checksums and sha256_file(shard) != entry.sha256:
            raise UserError(
                f"{path}: shard {shard} does not match its checksum (corrupt or overwritten); "
                f"delete it and {RERUN_HINT}"
            )
    return manifest


def merge_parts(parts: list[tuple[Path, ExtractPart]], manifest_path: Path) -> Manifest:
    """The extract jobs' parts as the one manifest: the same header in every part, one part
    for each job, every shard assigned and in place."""
    if not parts:
        raise UserError("no part manifests to merge")
    header = set(Header.model_fields)
    first_path, first = parts[0]
    common = first.model_dump(include=header)
    for path, part in parts[1:]:
        other = part.model_dump(include=header)
        diff = sorted(k for k in header if common.get(k) != other.get(k))
        if part.num_jobs != first.num_jobs:
            diff.append("num_jobs")
        if diff:
            raise UserError(
                f"{path} and {first_path} disagree on {', '.join(diff)}: they come from different "
                "extraction runs; rerun extraction"
            )
    check_parts(
        [part.job_index for _, part in parts],
        [part.shard_indices for _, part in parts],
        first.num_jobs,
        first.num_shards,
        "shards",
        "rerun extraction",
    )
    entries = {}
    for path, part in parts:
        for entry in part.shards:
            if entry.index in entries:
                raise UserError(f"shard {entry.index} appears in two parts (second: {path})")
            shard = (path.parent / entry.file).resolve()
            if not shard.is_file():
                raise UserError(f"{path}: shard {shard} is missing; {RERUN_HINT}")
            if shard.stat().st_size != entry.bytes:
                raise UserError(
                    f"{path}: shard {shard} has {shard.stat().st_size} bytes, its part recorded "
                    f"{entry.bytes}; it was overwritten: {RERUN_HINT}"
                )
            file = os.path.relpath(shard, manifest_path.parent.resolve())
            entries[entry.index] = entry.model_copy(update={"file": file})
    shards = [entries[i] for i in sorted(entries)]
    skipped = sorted(i for _, part in parts for i in part.skipped_too_long)
    manifest = Manifest(
        **{k: getattr(first, k) for k in Header.model_fields},
        num_samples=sum(e.num_samples for e in shards),
        num_tokens=sum(e.num_tokens for e in shards),
        num_loss_tokens=sum(e.num_loss_tokens for e in shards),
        num_skipped_too_long=len(skipped),
        skipped_too_long=skipped,
        bytes=sum(e.bytes for e in shards),
        shards=shards,
    )
    plans = [part.disk for _, part in parts]
    if all(plans):
        manifest.disk = disk_summary(plans, manifest)
    if manifest.num_samples == 0:
        raise UserError(
            "no sample was extracted (all too long?); raise extract.max_model_len_tokens"
        )
    return manifest


def disk_summary(plans: list[dict[str, Any]], manifest: Manifest) -> dict[str, Any]:
    """The jobs' disk plans as one: the shards' bytes as stored, and what they would take in each
    storage dtype, per token and against float32 (the report shows this). Only what the shards
    are: the same shards give the same manifest, whichever jobs made them and whatever the free
    space then (each job's log and part have that)."""
    tokens = max(manifest.num_tokens, 1)
    totals: dict[str, int] = {}
    for plan in plans:
        for name, v in plan["by_storage_dtype"].items():
            totals[name] = totals.get(name, 0) + int(v["bytes"])
    floor = totals.get("float32") or 1
    return {
        "storage_dtype": plans[0]["storage_dtype"],
        "bytes": manifest.bytes,
        "final_rows": sum(int(plan.get("final_rows", 0)) for plan in plans),
        "final_rows_saved_bytes": sum(int(plan.get("final_rows_saved_bytes", 0)) for plan in plans),
        "bytes_per_token": round(manifest.bytes / tokens, 2),
        "by_storage_dtype": {
            name: {
                "bytes": total,
                "bytes_per_token": round(total / tokens, 2),
                "vs_float32": round(total / floor, 4),
            }
            for name, total in totals.items()
        },
    }
