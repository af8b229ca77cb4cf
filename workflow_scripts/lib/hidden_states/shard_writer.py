"""Writing shards (the format is in ``shards.py``) as extraction streams them: ``ShardWriter``
lays a shard out up front in a temporary file; each sample's rows are encoded and written at their
place (``target``), by this process or by the vLLM worker (``connector.py``); the file is renamed
into place when every sample is in. ``ShardJob`` is one shard an engine computes: its samples and
its writer.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workflow_scripts.lib.common import sha256_file, write_json
from workflow_scripts.lib.hidden_states.shards import (
    DTYPE_NAMES,
    SampleStates,
    TORCH_DTYPES,
    encode_states,
    read_runs,
    select_rows,
    shard_layout,
)

SHA_SIDECAR = ".sha256.json"  # beside each shard: its entry, so a reuse does not re-hash it


def pwrite_tensor(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Write a tensor's bytes (made contiguous, on the CPU) at ``offset`` of an open file."""
    if tensor.numel() == 0:
        return
    data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def encode_sample(aux: torch.Tensor, final: torch.Tensor, target: dict) -> dict[str, torch.Tensor]:
    """One sample's states, ``aux`` [T, n_aux, H] and ``final`` [T, H], as its ``target`` stores
    them: the final rows the loss reads, everything in the storage dtype (on the input's
    device)."""
    final = select_rows(final, target["final_runs"])
    return encode_states(aux, final, TORCH_DTYPES[target["storage_dtype"]])


def write_encoded(path: str | Path, encoded: dict[str, torch.Tensor], target: dict) -> None:
    """Write one sample's encoded rows (``encode_sample``) where ``target`` says."""
    if set(encoded) != set(target["offsets"]):
        raise ValueError(
            f"sample rows {sorted(encoded)}, the shard stores {sorted(target['offsets'])}"
        )
    for name, tensor in encoded.items():
        expected = target["num_tokens"] if name.startswith("aux") else target["num_final_rows"]
        if tensor.shape[0] != expected:
            raise ValueError(
                f"sample has {tensor.shape[0]} rows of {name}, its place in the shard expects "
                f"{expected}"
            )
    fd = os.open(str(path), os.O_WRONLY)
    try:
        for name, tensor in encoded.items():
            pwrite_tensor(fd, tensor, int(target["offsets"][name]))
    finally:
        os.close(fd)


def write_sample_rows(path: str | Path, aux: torch.Tensor, final: torch.Tensor, target: dict):
    """Encode and write one sample's states (``encode_sample``)."""
    if aux.shape[0] != target["num_tokens"] or final.shape[0] != target["num_tokens"]:
        raise ValueError(
            f"sample has {aux.shape[0]} tokens, its place in the shard expects "
            f"{target['num_tokens']}"
        )
    write_encoded(path, encode_sample(aux, final, target), target)


def tmp_shard_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_stale_tmp(path: Path) -> int:
    """Delete partial files left by killed writers of ``path``; returns how many."""
    removed = 0
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        stale.unlink(missing_ok=True)
        removed += 1
    return removed


def cumulative(counts: list[int]) -> torch.Tensor:
    out = torch.zeros(len(counts) + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return out


class ShardWriter:
    """One shard, streamed into a temporary file and renamed into place by ``finish``. The
    hidden-state regions start as holes and are filled per sample through ``put`` or by whoever
    is given ``target(i)``."""

    def __init__(
        self,
        path: Path,
        input_ids: list[torch.Tensor],
        loss_masks: list[torch.Tensor],
        num_aux_layers: int,
        hidden_size: int,
        storage: torch.dtype,
        metadata: dict[str, str],
    ):
        if not input_ids:
            raise ValueError("a shard needs at least one sample")
        self.path = Path(path)
        self.tmp = tmp_shard_path(self.path)
        self.num_samples = len(input_ids)
        self.storage = storage
        self.runs = [read_runs(m) for m in loss_masks]
        self.offsets = cumulative([int(t.numel()) for t in input_ids])
        self.final_offsets = cumulative([sum(b - a for a, b in r) for r in self.runs])
        self.num_tokens = int(self.offsets[-1])
        self.layout = shard_layout(
            self.num_samples,
            self.num_tokens,
            int(self.final_offsets[-1]),
            num_aux_layers,
            hidden_size,
            storage,
            metadata,
        )
        start, begin = self.layout.data_start, self.layout.begin
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.tmp), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, self.layout.file_bytes)
            os.pwrite(fd, struct.pack("<Q", len(self.layout.header)) + self.layout.header, 0)
            pwrite_tensor(fd, self.offsets, start + begin["sample_offsets"])
            pwrite_tensor(fd, self.final_offsets, start + begin["final_offsets"])
            ids = torch.cat([t.to(torch.int64) for t in input_ids])
            pwrite_tensor(fd, ids, start + begin["input_ids"])
            mask = torch.cat([m.to(torch.uint8) for m in loss_masks])
            pwrite_tensor(fd, mask, start + begin["loss_mask"])
        finally:
            os.close(fd)
        self.missing = set(range(self.num_samples))

    @property
    def file_bytes(self) -> int:
        return self.layout.file_bytes

    def target(self, i: int) -> dict[str, object]:
        """Where sample ``i``'s rows go (JSON-serialisable): the file, the storage dtype, the
        runs of positions whose final state is stored, and the byte offset of each stored
        tensor's rows."""
        first, final_first = int(self.offsets[i]), int(self.final_offsets[i])
        start, begin, row = self.layout.data_start, self.layout.begin, self.layout.row_bytes
        offsets = {}
        for name in ("aux_hidden_states", "aux_scales", "final_hidden_states", "final_scales"):
            if name in begin:
                at = first if name.startswith("aux") else final_first
                offsets[name] = start + begin[name] + at * row[name]
        return {
            "path": str(self.tmp.resolve()),
            "storage_dtype": DTYPE_NAMES[self.storage],
            "num_tokens": int(self.offsets[i + 1]) - first,
            "num_final_rows": int(self.final_offsets[i + 1]) - final_first,
            "final_runs": self.runs[i],
            "offsets": offsets,
        }

    def put(self, i: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        write_sample_rows(self.tmp, aux, final, self.target(i))
        self.done(i)

    def done(self, i: int) -> None:
        self.missing.discard(i)

    @property
    def complete(self) -> bool:
        return not self.missing

    def finish(self, extra: dict[str, object] | None = None) -> dict[str, object]:
        """fsync, rename into place; return the manifest entry (file name relative)."""
        if self.missing:
            raise RuntimeError(f"{self.path.name}: samples {sorted(self.missing)[:5]} not written")
        fd = os.open(str(self.tmp), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        entry = {**shard_entry(self.tmp), "file": self.path.name}  # hashed before it is seen
        os.replace(self.tmp, self.path)
        return {**entry, **(extra or {})}

    def abort(self) -> None:
        self.tmp.unlink(missing_ok=True)


def shard_entry(path: Path) -> dict[str, object]:
    """The manifest entry of a finished shard, read from the file (checksum included)."""
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
        offsets = fh.get_tensor("sample_offsets")
        num_loss_tokens = int(fh.get_tensor("loss_mask").sum())
    return {
        "file": path.name,
        "sample_start": int(meta.get("sample_start", 0)),
        "num_samples": int(offsets.numel() - 1),
        "num_tokens": int(offsets[-1]),
        "num_loss_tokens": num_loss_tokens,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def remember_entry(path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` (a finished shard's, ``shard_entry``) kept beside it with its size and mtime."""
    st = path.stat()
    write_json(
        path.with_name(path.name + SHA_SIDECAR),
        {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "entry": entry},
    )
    return entry


@dataclass
class ShardJob:
    """One shard to compute: its writer (created lazily) and the samples going into it."""

    index: int
    path: Path
    samples: list[tuple[torch.Tensor, torch.Tensor]]  # (input_ids, loss_mask) per sample
    metadata: dict[str, str]
    writer: ShardWriter | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def open(self, num_aux: int, hidden_size: int, storage: torch.dtype) -> ShardWriter:
        if self.writer is None:
            self.writer = ShardWriter(
                self.path,
                [ids for ids, _ in self.samples],
                [mask for _, mask in self.samples],
                num_aux,
                hidden_size,
                storage,
                self.metadata,
            )
        return self.writer


def write_samples(
    path: Path,
    samples: list[SampleStates],
    metadata: dict[str, str],
    storage: torch.dtype | None = None,
) -> dict[str, object]:
    """A whole shard of samples whose states are in memory, through the writer extraction uses
    (``storage`` None: the states' own dtype); returns its manifest entry (file name relative)."""
    first = samples[0].aux_hidden_states
    writer = ShardWriter(
        path,
        [s.input_ids for s in samples],
        [s.loss_mask for s in samples],
        int(first.shape[1]),
        int(first.shape[2]),
        storage or first.dtype,
        metadata,
    )
    for i, sample in enumerate(samples):
        writer.put(i, sample.aux_hidden_states, sample.final_hidden_states)
    return writer.finish()
