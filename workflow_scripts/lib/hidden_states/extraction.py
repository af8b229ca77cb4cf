"""Hidden-state extraction, everything but the entry: the shard plan and its checks, the run of
an engine over the shards still to compute, and a job's part manifest.

The samples (lines of tokenized_data.jsonl) are cut into shards of ``shard_size_samples``:
shard i holds samples [i*S, (i+1)*S), and job j of ``num_jobs`` computes the shards with
i % num_jobs == j. Every shard carries a fingerprint of what it was computed from (its own
samples: their range, their bytes and the ones skipped as too long; the verifier's identity, layer
ids, dtypes, backend, the fingerprint of the code that computes shards). Not the rest of the data:
tokenized data grown at its end keeps every full shard before the new samples. A shard whose file
exists with the expected fingerprint is reused; every other one is computed into a temporary file
and renamed when complete, so a killed job redoes only the shards it had not finished, and a job
with nothing left to do never loads the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.hidden_states.manifest import FORMAT_VERSION, LAYER_CONVENTION, shard_name
from workflow_scripts.lib.hidden_states.records import ExtractPart
from workflow_scripts.lib.hidden_states.shard_plan import (
    Plan,
    ShardPlan,
    fingerprint,
    read_rows,
    sample_tensors,
    shard_key,
)
from workflow_scripts.lib.hidden_states.shard_writer import (
    SHA_SIDECAR,
    remember_entry,
    remove_stale_tmp,
    shard_entry,
)
from workflow_scripts.lib.hidden_states.shards import (
    read_positions,
    shard_fingerprint,
    storage_dtype_name,
)
from workflow_scripts.lib.verifier import engine, preflight
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.code_inputs import made_by, shard_code_fingerprint
from workflow_scripts.lib.workflow.jobs import job_units
from workflow_scripts.lib.workflow.layout import STATS

log = logging.getLogger("eagle3")
MAX_LISTED = 5


# --------------------------------------------------------------------------- data


def index_lines(path: Path) -> tuple[np.ndarray, str]:
    """Byte offsets of every line start (one extra: the end) and the file's sha256, in one read."""
    digest = hashlib.sha256()
    starts = [np.zeros(1, dtype=np.int64)]
    pos = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            starts.append(nl.astype(np.int64) + pos + 1)
            pos += len(chunk)
    offsets = np.concatenate(starts)
    if offsets[-1] != pos:  # a last line without a newline
        offsets = np.append(offsets, pos)
    return offsets, digest.hexdigest()


def lines_sha256(path: Path, offsets: np.ndarray, start: int, end: int) -> str:
    """sha256 of the bytes of lines [start, end)."""
    digest = hashlib.sha256()
    left = int(offsets[end] - offsets[start])
    with open(path, "rb") as fh:
        fh.seek(int(offsets[start]))
        while left > 0 and (chunk := fh.read(min(left, 1 << 24))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- plan


def existing_entry(shard: ShardPlan) -> dict[str, Any] | None:
    """The manifest entry of a finished shard with the expected fingerprint, else None."""
    if shard_fingerprint(shard.path) != shard.fingerprint:
        return None
    st = shard.path.stat()
    sidecar = shard.path.with_name(shard.path.name + SHA_SIDECAR)
    try:
        cached = json.loads(sidecar.read_text())
        if cached["size"] == st.st_size and cached["mtime_ns"] == st.st_mtime_ns:
            return cached["entry"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return remember_entry(shard.path, shard_entry(shard.path))


def reuse_finished(plan: Plan) -> None:
    """Finds the finished shards (``entry`` set) and removes what killed runs left half-written."""
    for shard in plan.shards:
        stale = remove_stale_tmp(shard.path)
        if stale:
            log.info("shard %d: removed %d partial file(s) of a killed run", shard.index, stale)
        shard.entry = existing_entry(shard)


def make_plan(io, p) -> Plan:
    """Every check that needs no model, in order; a UserError at the first failure."""
    cfg = verifier_files.verifier_config(io.verifier)
    identity = verifier_files.identity(io.verifier)  # the weight files checked too
    preflight.check_extract(p, cfg)
    aux_ids = verifier_files.aux_layer_ids(cfg, p.aux_layer_ids)
    dtype = engine.resolve_dtype(p, cfg)
    storage = storage_dtype_name(p.storage_dtype, dtype)
    vocab_size = int(cfg["vocab_size"])
    n = int(cfg["num_hidden_layers"])

    if not io.tokenized.is_file():
        raise UserError(f"tokenized data '{io.tokenized}' does not exist; run the prepare stage")
    offsets, data_sha = index_lines(io.tokenized)
    num_samples = len(offsets) - 1
    if num_samples == 0:
        raise UserError(
            f"tokenized data '{io.tokenized}' is empty: nothing to extract (did the prepare stage "
            f"drop every conversation? see {io.tokenized.parent / STATS})"
        )
    common = {
        "format_version": FORMAT_VERSION,
        "made_by": made_by("extract", code=shard_code_fingerprint()),
        "layer_convention": LAYER_CONVENTION,
        "aux_layer_ids": aux_ids,
        "final_layer_id": n,
        "hidden_size": int(cfg["hidden_size"]),
        "num_hidden_layers": n,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "storage_dtype": storage,
        "backend": p.backend,
        "verifier": {
            "path": str(io.verifier.resolve()),
            "architectures": cfg.get("architectures"),
            **identity,
        },
        "tokenized": {
            "path": str(io.tokenized.resolve()),
            "sha256": data_sha,
            "num_samples": num_samples,
        },
        "shard_size_samples": p.shard_size_samples,
        "num_shards": -(-num_samples // p.shard_size_samples),
        "max_model_len_tokens": p.max_model_len_tokens,
        "on_too_long": p.on_too_long,
    }
    # what every shard's content depends on besides its own samples (paths, shard count and
    # policies are not part of it; nor the rest of the data)
    key = {
        "format_version": FORMAT_VERSION,
        "verifier": identity["fingerprint"],
        "aux_layer_ids": aux_ids,
        "final_layer_id": n,
        "dtype": dtype,
        "backend": p.backend,
        "code": shard_code_fingerprint(),
    }
    plan = Plan(io.verifier, cfg, aux_ids, dtype, storage, common, key, offsets, num_samples)

    # this job's shards: read and check its samples (lengths only are kept)
    limit = p.max_model_len_tokens - 1  # vLLM keeps one position for the generated token
    too_long: list[tuple[int, int]] = []
    S = p.shard_size_samples
    for index in job_units(io.job_index, p.num_jobs, common["num_shards"], "extract"):
        shard = ShardPlan(
            index,
            index * S,
            min((index + 1) * S, num_samples),
            [],
            [],
            [],
            io.shard_dir / shard_name(index),
        )
        for i, row in read_rows(io.tokenized, offsets, list(range(shard.start, shard.end))):
            ids, mask = sample_tensors(io.tokenized, i, row, vocab_size)
            length = ids.numel()
            if length > limit:
                too_long.append((i, length))
                shard.skipped.append(i)
            else:
                shard.samples.append(i)
                shard.lengths.append(length)
                shard.sample_final_rows.append(len(read_positions(mask)))
                shard.final_rows += shard.sample_final_rows[-1]
        shard.rows_sha256 = lines_sha256(io.tokenized, offsets, shard.start, shard.end)
        shard.fingerprint = fingerprint(shard_key(key, storage), shard)
        plan.shards.append(shard)
    if too_long and p.on_too_long == "fail":
        first = ", ".join(f"line {i + 1} ({n_tok} tokens)" for i, n_tok in too_long[:MAX_LISTED])
        raise UserError(
            f"{io.tokenized}: {len(too_long)} sample(s) of this job have {p.max_model_len_tokens} "
            f"tokens or more, too long for extract.max_model_len_tokens {p.max_model_len_tokens} "
            f"(one position is kept for the generated token): {first}. Raise "
            "extract.max_model_len_tokens, or set extract.on_too_long: skip to skip and count them"
        )
    if too_long:
        log.warning(
            "skipping %d sample(s) too long for extract.max_model_len_tokens %d (counted in the "
            "manifest)",
            len(too_long),
            p.max_model_len_tokens,
        )
    return plan


def part_manifest(io, p, plan: Plan, disk: dict[str, Any]) -> ExtractPart:
    shards = []
    for s in plan.shards:
        if s.entry is None or s.entry.get("file") is None:
            continue
        rel = os.path.relpath(s.path.resolve(), io.part.parent.resolve())
        shards.append(
            {
                **s.entry,
                "index": s.index,
                "file": rel,
                "sample_end": s.end,
                "num_skipped": len(s.skipped),
                "fingerprint": s.fingerprint,
            }
        )
    skipped = sorted(i for s in plan.shards for i in s.skipped)
    return ExtractPart(
        **plan.common,
        kind="extract_part",
        job_index=io.job_index,
        num_jobs=p.num_jobs,
        shard_indices=[s.index for s in plan.shards],
        disk=disk,
        num_samples=sum(e["num_samples"] for e in shards),
        num_tokens=sum(e["num_tokens"] for e in shards),
        num_skipped_too_long=len(skipped),
        skipped_too_long=skipped,
        shards=shards,
    )
