"""extract_merge: the extraction jobs' part manifests -> one manifest of all shards.

Checks that the parts agree (same data, verifier, layers, dtype, shard size and job count), that
every shard index appears exactly once and that every shard file is there with the size its part
recorded. Shard paths in the manifest are relative to the manifest's directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from workflow_scripts import cli
from workflow_scripts.common import UserError, read_json, run_main, write_json
from workflow_scripts.shards import FORMAT_VERSION, RERUN_HINT

log = logging.getLogger("eagle3")

# keys of a part that are per job, not shared by all parts
PER_JOB = {
    "kind",
    "job_index",
    "shard_indices",
    "num_samples",
    "num_tokens",
    "num_skipped_too_long",
    "skipped_too_long",
    "shards",
}


def merge(parts: list[tuple[Path, dict[str, Any]]], manifest_path: Path) -> dict[str, Any]:
    if not parts:
        raise UserError("no part manifests to merge")
    first_path, first = parts[0]
    common = {k: v for k, v in first.items() if k not in PER_JOB}
    if common.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{first_path}: format_version {common.get('format_version')!r}; rerun extraction"
        )
    for path, part in parts[1:]:
        other = {k: v for k, v in part.items() if k not in PER_JOB}
        diff = sorted(k for k in set(common) | set(other) if common.get(k) != other.get(k))
        if diff:
            raise UserError(
                f"{path} and {first_path} disagree on {', '.join(diff)}: they come from different "
                "extraction runs; rerun extraction"
            )
    num_jobs = int(common["num_jobs"])
    jobs = sorted(int(part["job_index"]) for _, part in parts)
    if jobs != list(range(num_jobs)):
        raise UserError(f"parts of jobs {jobs}, expected one for each of 0..{num_jobs - 1}")

    entries: dict[int, dict[str, Any]] = {}
    assigned: set[int] = set()
    for path, part in parts:
        assigned.update(part["shard_indices"])
        for entry in part["shards"]:
            index = int(entry["index"])
            if index in entries:
                raise UserError(f"shard {index} appears in two parts (second: {path})")
            shard = (path.parent / entry["file"]).resolve()
            if not shard.is_file():
                raise UserError(f"{path}: shard {shard} is missing; {RERUN_HINT}")
            if shard.stat().st_size != entry["bytes"]:
                raise UserError(
                    f"{path}: shard {shard} has {shard.stat().st_size} bytes, its part recorded "
                    f"{entry['bytes']}; it was overwritten: {RERUN_HINT}"
                )
            entries[index] = {
                **entry,
                "file": os.path.relpath(shard, manifest_path.parent.resolve()),
            }
    missing = sorted(set(range(int(common["num_shards"]))) - assigned)
    if missing:
        raise UserError(f"shards {missing[:10]} were assigned to no job; rerun extraction")
    shards = [entries[i] for i in sorted(entries)]
    skipped = sorted(i for _, part in parts for i in part["skipped_too_long"])
    manifest = {
        **common,
        "num_samples": sum(e["num_samples"] for e in shards),
        "num_tokens": sum(e["num_tokens"] for e in shards),
        "num_loss_tokens": sum(e.get("num_loss_tokens", 0) for e in shards),
        "num_skipped_too_long": len(skipped),
        "skipped_too_long": skipped,
        "bytes": sum(e["bytes"] for e in shards),
        "shards": shards,
    }
    if manifest["num_samples"] == 0:
        raise UserError(
            "no sample was extracted (all too long?); raise extract.max_model_len_tokens"
        )
    return manifest


def main() -> None:
    io, _ = cli.parse("extract_merge")
    parts = [(Path(p), read_json(p)) for p in io.parts]
    manifest = merge(parts, Path(io.manifest))
    write_json(io.manifest, manifest)
    log.info(
        "manifest: %d shards, %d samples, %d tokens (%d skipped as too long), %.2f GiB -> %s",
        len(manifest["shards"]),
        manifest["num_samples"],
        manifest["num_tokens"],
        manifest["num_skipped_too_long"],
        manifest["bytes"] / 2**30,
        io.manifest,
    )


if __name__ == "__main__":
    run_main(main)
