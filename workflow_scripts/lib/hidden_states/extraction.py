"""Hidden-state extraction, everything but the entry: the shard plan and its checks, the run of
an engine over the shards still to compute, and a job's part manifest.

The samples (lines of tokenized_data.jsonl) are cut into shards of ``shard_size_samples``:
shard i holds samples [i*S, (i+1)*S), and job j of ``num_jobs`` computes the shards with
i % num_jobs == j. Every shard carries a fingerprint of what it was computed from (the data's
sha256, the verifier's identity, layer ids, dtypes, backend, the fingerprint of the code that
computes shards, sample range and the samples skipped in it). A shard whose file exists with the expected fingerprint is reused; every other one is
computed into a temporary file and renamed when complete, so a killed job redoes only the shards
it had not finished, and a job with nothing left to do never loads the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from workflow_scripts.lib.common import UserError, write_json
from workflow_scripts.lib.hidden_states.manifest import FORMAT_VERSION, LAYER_CONVENTION, shard_name
from workflow_scripts.lib.hidden_states.records import ExtractPart
from workflow_scripts.lib.hidden_states.shard_writer import remove_stale_tmp, shard_entry
from workflow_scripts.lib.hidden_states.shards import (
    TORCH_DTYPES,
    read_positions,
    shard_fingerprint,
    shard_layout,
    storage_dtype_name,
)
from workflow_scripts.lib.verifier import engine, preflight
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.code_inputs import (
    made_by,
    resume_key,
    shard_code_fingerprint,
)
from workflow_scripts.lib.workflow.jobs import job_units
from workflow_scripts.lib.workflow.layout import STATS

log = logging.getLogger("eagle3")
SHA_SIDECAR = ".sha256.json"  # beside each shard: its checksum, so a reuse does not re-hash it
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


def read_rows(path: Path, offsets: np.ndarray, indices: list[int]) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as fh:
        for i in indices:
            fh.seek(int(offsets[i]))
            raw = fh.read(int(offsets[i + 1] - offsets[i]))
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise UserError(f"{path}:{i + 1}: not a JSON line ({exc})") from None
            yield i, row


def sample_tensors(
    path: Path, i: int, row: Any, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"{path}:{i + 1}"
    if not isinstance(row, dict) or "input_ids" not in row or "loss_mask" not in row:
        raise UserError(f"{where}: expected an object with input_ids and loss_mask")
    try:
        ids = torch.tensor(row["input_ids"], dtype=torch.int64)
        mask = torch.tensor(row["loss_mask"], dtype=torch.uint8)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise UserError(
            f"{where}: input_ids / loss_mask are not lists of integers ({exc})"
        ) from None
    if ids.ndim != 1 or ids.numel() == 0:
        raise UserError(f"{where}: input_ids is empty or not a flat list")
    if mask.shape != ids.shape:
        raise UserError(f"{where}: loss_mask has {mask.numel()} entries, input_ids {ids.numel()}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise UserError(
            f"{where}: token id {int(ids.max())} is outside the verifier's vocabulary of "
            f"{vocab_size}; was the data tokenized for another verifier?"
        )
    return ids, mask


# --------------------------------------------------------------------------- plan


@dataclass
class ShardPlan:
    index: int
    start: int  # first sample (line) index
    end: int  # one past the last
    samples: list[int]  # the sample indices kept (too-long ones skipped)
    lengths: list[int]
    skipped: list[int]
    path: Path
    fingerprint: str = ""
    final_rows: int = 0  # final states stored: at the positions the loss reads
    sample_final_rows: list[int] = field(default_factory=list)  # the same, per sample kept
    entry: dict[str, Any] | None = None  # the manifest entry when already finished

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class Plan:
    verifier: Path
    cfg: dict[str, Any]
    aux_ids: list[int]
    dtype: str  # the compute dtype
    storage: str  # the dtype the shards store the states in
    common: dict[str, Any]
    key: dict[str, Any]  # what every shard's content depends on (its fingerprint, with its range)
    line_offsets: np.ndarray
    num_samples: int
    shards: list[ShardPlan] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return int(self.cfg["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.cfg["hidden_size"])

    @property
    def todo(self) -> list[ShardPlan]:
        return [s for s in self.shards if s.entry is None]

    def shard_metadata(self, shard: ShardPlan, storage: str | None = None) -> dict[str, str]:
        """The safetensors metadata of a shard (stored as ``storage``, by default the plan's)."""
        storage = storage or self.storage
        return {
            "fingerprint": (
                shard.fingerprint
                if storage == self.storage
                else fingerprint(shard_key(self.key, storage), shard)
            ),
            "sample_start": str(shard.start),
            "sample_end": str(shard.end),
            "skipped_samples": json.dumps(shard.skipped),
            "aux_layer_ids": json.dumps(self.aux_ids),
            "final_layer_id": str(self.num_layers),
            "layer_convention": LAYER_CONVENTION,
            "dtype": self.dtype,
            "storage_dtype": storage,
            "format_version": str(FORMAT_VERSION),
        }

    def shard_bytes(self, shard: ShardPlan, storage: str | None = None) -> int:
        """The exact size of a shard's file (0 when every sample of it is skipped)."""
        if not shard.samples:
            return 0
        layout = shard_layout(
            len(shard.samples),
            shard.num_tokens,
            shard.final_rows,
            len(self.aux_ids),
            self.hidden_size,
            TORCH_DTYPES[storage or self.storage],
            self.shard_metadata(shard, storage),
        )
        return layout.file_bytes


def shard_key(key: dict[str, Any], storage: str) -> dict[str, Any]:
    """The fingerprint key for a storage dtype. Stored as computed, the key is the one shards had
    before storage dtypes existed, so that those shards stay valid."""
    return key if storage == key["dtype"] else {**key, "storage_dtype": storage}


def fingerprint(common_key: dict[str, Any], shard: ShardPlan) -> str:
    """A shard's resume key: ``common_key`` (its ``code``, the shards' code fingerprint, apart)
    and its samples."""
    what = {k: v for k, v in common_key.items() if k != "code"}
    return resume_key(
        {**what, "sample_range": [shard.start, shard.end], "skipped": shard.skipped},
        common_key["code"],
    )


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


def remember_entry(path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    st = path.stat()
    write_json(
        path.with_name(path.name + SHA_SIDECAR),
        {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "entry": entry},
    )
    return entry


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
    # what a shard's content depends on (paths, shard count and policies are not part of it)
    key = {
        "format_version": FORMAT_VERSION,
        "data_sha256": data_sha,
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
