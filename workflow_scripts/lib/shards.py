"""Hidden-state shards: the on-disk format shared by extraction (writer) and training (reader).

A shard is one safetensors file holding a fixed run of consecutive samples, concatenated along the
token axis with no padding:

* ``aux_hidden_states``   [T, n_aux, H]  verifier dtype: the auxiliary layers, in ``aux_layer_ids``
  order (vLLM's convention: id k = input of decoder layer k = HF ``hidden_states[k]``)
* ``final_hidden_states`` [T, H]         verifier dtype: the last layer's output *before* the final
  norm (layer id N)
* ``input_ids``           [T]            int64
* ``loss_mask``           [T]            uint8 (1 on assistant tokens)
* ``sample_offsets``      [S + 1]        int64: sample s is tokens offsets[s]:offsets[s+1]

The safetensors metadata holds ``fingerprint`` (what the shard was computed from: data, verifier,
layers, dtype, sample range) and ``sample_start``. ``ShardWriter`` streams a shard: it lays out the
file up front (the token count of every sample is known before extraction), writes token ids,
loss mask and offsets at once, and each sample's hidden-state rows when they arrive, possibly from
another process (the vLLM worker, see ``hidden_states_connector.py``); the file gets its final
name only when every sample is in. The manifest (``manifest.py``) lists the shards with sample
and token counts and a sha256 each, plus the layer ids, convention, dtype and verifier identity;
downstream rules depend on the manifest only.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workflow_scripts.lib.common import atomic_path, sha256_file

TENSORS = ("aux_hidden_states", "final_hidden_states", "input_ids", "loss_mask", "sample_offsets")


@dataclass
class SampleStates:
    aux_hidden_states: torch.Tensor  # [T, n_aux, H]
    final_hidden_states: torch.Tensor  # [T, H]
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8 / bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def write_shard(path: Path, samples: list[SampleStates], sample_start: int, fingerprint: str):
    """Write samples as one shard, atomically; return its manifest entry (file name relative)."""
    lengths = torch.tensor([s.num_tokens for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    tensors = {
        "aux_hidden_states": torch.cat([s.aux_hidden_states for s in samples]).contiguous(),
        "final_hidden_states": torch.cat([s.final_hidden_states for s in samples]).contiguous(),
        "input_ids": torch.cat([s.input_ids.to(torch.int64) for s in samples]).contiguous(),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]).contiguous(),
        "sample_offsets": offsets,
    }
    meta = {"fingerprint": fingerprint, "sample_start": str(sample_start)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return {
        "file": path.name,
        "sample_start": sample_start,
        "num_samples": len(samples),
        "num_tokens": int(offsets[-1]),
        "sha256": sha256_file(path),
    }


def shard_fingerprint(path: Path) -> str | None:
    """The fingerprint a finished shard was written with, or None if unreadable/absent."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return (fh.metadata() or {}).get("fingerprint")
    except Exception:
        return None


class ShardReader:
    """Memory-mapped access to one shard's samples; tensors are read only when asked for."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh = safe_open(str(self.path), framework="pt")
        self.offsets = self._fh.get_tensor("sample_offsets")

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def sample(self, i: int) -> SampleStates:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return SampleStates(
            aux_hidden_states=self._fh.get_slice("aux_hidden_states")[a:b],
            final_hidden_states=self._fh.get_slice("final_hidden_states")[a:b],
            input_ids=self._fh.get_slice("input_ids")[a:b],
            loss_mask=self._fh.get_slice("loss_mask")[a:b],
        )

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


# --------------------------------------------------------------------------- streaming writer

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.uint8: "U8",
}
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def pwrite_tensor(fd: int, tensor: torch.Tensor, offset: int) -> None:
    """Write a tensor's bytes (made contiguous, on the CPU) at ``offset`` of an open file."""
    data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def write_sample_rows(path: str | Path, aux: torch.Tensor, final: torch.Tensor, target: dict):
    """Write one sample's states, ``aux`` [T, n_aux, H] and ``final`` [T, H], where ``target``
    (from ``ShardWriter.target``) says."""
    num_tokens = int(target["num_tokens"])
    if aux.shape[0] != num_tokens or final.shape[0] != num_tokens:
        raise ValueError(
            f"sample has {aux.shape[0]} tokens, its place in the shard expects {num_tokens}"
        )
    fd = os.open(str(path), os.O_WRONLY)
    try:
        pwrite_tensor(fd, aux, int(target["aux_offset"]))
        pwrite_tensor(fd, final, int(target["final_offset"]))
    finally:
        os.close(fd)


def tmp_shard_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_stale_tmp(path: Path) -> int:
    """Delete partial files left by killed writers of ``path``; returns how many."""
    removed = 0
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        stale.unlink(missing_ok=True)
        removed += 1
    return removed


class ShardWriter:
    """One shard, streamed into a temporary file and renamed into place by ``finish``.

    The tensors are laid out as ``sample_offsets``, ``input_ids`` (8-byte aligned first), then
    ``aux_hidden_states``, ``final_hidden_states``, ``loss_mask``; the hidden-state regions start
    as holes and are filled per sample through ``put`` or by whoever is given ``target(i)``.
    """

    def __init__(
        self,
        path: Path,
        input_ids: list[torch.Tensor],
        loss_masks: list[torch.Tensor],
        num_aux_layers: int,
        hidden_size: int,
        dtype: torch.dtype,
        metadata: dict[str, str],
    ):
        if not input_ids:
            raise ValueError("a shard needs at least one sample")
        self.path = Path(path)
        self.tmp = tmp_shard_path(self.path)
        self.num_samples = len(input_ids)
        lengths = torch.tensor([int(t.numel()) for t in input_ids], dtype=torch.int64)
        self.offsets = torch.zeros(self.num_samples + 1, dtype=torch.int64)
        self.offsets[1:] = torch.cumsum(lengths, 0)
        self.num_tokens = int(self.offsets[-1])
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.aux_row = num_aux_layers * hidden_size * self.elem  # bytes per token
        self.final_row = hidden_size * self.elem
        T = self.num_tokens
        specs = [
            ("sample_offsets", torch.int64, [self.num_samples + 1], 8 * (self.num_samples + 1)),
            ("input_ids", torch.int64, [T], 8 * T),
            ("aux_hidden_states", dtype, [T, num_aux_layers, hidden_size], T * self.aux_row),
            ("final_hidden_states", dtype, [T, hidden_size], T * self.final_row),
            ("loss_mask", torch.uint8, [T], T),
        ]
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        self.begin: dict[str, int] = {}
        pos = 0
        for name, dt, shape, nbytes in specs:
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dt],
                "shape": shape,
                "data_offsets": [pos, pos + nbytes],
            }
            self.begin[name] = pos
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.file_bytes = self.data_start + pos
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.tmp), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, self.file_bytes)
            os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
            pwrite_tensor(fd, self.offsets, self.data_start + self.begin["sample_offsets"])
            pwrite_tensor(
                fd,
                torch.cat([t.to(torch.int64) for t in input_ids]),
                self.data_start + self.begin["input_ids"],
            )
            pwrite_tensor(
                fd,
                torch.cat([m.to(torch.uint8) for m in loss_masks]),
                self.data_start + self.begin["loss_mask"],
            )
        finally:
            os.close(fd)
        self.missing = set(range(self.num_samples))

    def target(self, i: int) -> dict[str, object]:
        """Where sample ``i``'s rows go: the file and byte offsets (JSON-serialisable)."""
        first = int(self.offsets[i])
        return {
            "path": str(self.tmp.resolve()),
            "aux_offset": self.data_start + self.begin["aux_hidden_states"] + first * self.aux_row,
            "final_offset": self.data_start
            + self.begin["final_hidden_states"]
            + first * self.final_row,
            "num_tokens": int(self.offsets[i + 1]) - first,
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
        os.replace(self.tmp, self.path)
        return {**shard_entry(self.path), **(extra or {})}

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
