"""Hidden-state shards: the on-disk format shared by extraction (writer) and training (reader).

A shard is one safetensors file holding a fixed run of consecutive samples, concatenated along the
token axis with no padding:

* ``aux_hidden_states``   [T, n_aux, H]  storage dtype: the auxiliary layers, in ``aux_layer_ids``
  order (vLLM's convention: id k = input of decoder layer k = HF ``hidden_states[k]``)
* ``final_hidden_states`` [F, H]         storage dtype: the last layer's output *before* the final
  norm (layer id N), only at the positions whose final state training reads: position j where
  token j+1 is an assistant token (``read_positions``: the teacher of the token at j+1). The
  other positions are never read; the reader gives zeros there.
* ``input_ids``           [T]            int64
* ``loss_mask``           [T]            uint8 (1 on assistant tokens)
* ``sample_offsets``      [S + 1]        int64: sample s is tokens offsets[s]:offsets[s+1]
* ``final_offsets``       [S + 1]        int64: sample s's final rows are final_offsets[s]:[s+1]

Shards written before ``final_offsets`` existed hold ``final_hidden_states`` [T, H] at every
position; the reader reads both.

The storage dtype (``extract.storage_dtype``) is the verifier's compute dtype, bfloat16, or
float8_e4m3fn. With float8 every row of H values (one token, one layer) has its own scale:

* ``aux_scales``          [T, n_aux]     float32
* ``final_scales``        [F]            float32

and the value is ``float(stored) * scale``; the scale is the row's largest magnitude / 448 (the
largest float8_e4m3fn), so each row uses the whole float8 range. ``encode_states`` encodes where
the states are gathered (on a GPU before the copy to host memory), ``ShardReader`` decodes.

The safetensors metadata holds ``fingerprint`` (what the shard was computed from: data, verifier,
layers, dtypes, sample range) and ``sample_start``. ``shard_writer.ShardWriter`` streams a shard:
it lays out the file up front (``shard_layout``: the token ids and loss mask of every sample are
known before extraction), writes token ids, loss mask and offsets at once, and each sample's
hidden-state rows when they arrive, possibly from another process (the vLLM worker, see
``connector.py``); the file gets its final name only when every sample is in. The manifest
(``manifest.py``) lists the shards with sample and token counts and a sha256 each, plus the layer
ids, convention, dtypes and verifier identity; downstream rules depend on the manifest only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
ENCODE_CHUNK_ROWS = 2048  # tokens encoded at a time: bounds the float32 temporary on a GPU
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    FP8: "F8_E4M3",
    torch.int64: "I64",
    torch.uint8: "U8",
}
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": FP8,
}
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


@dataclass
class SampleStates:
    aux_hidden_states: torch.Tensor  # [T, n_aux, H]
    final_hidden_states: torch.Tensor  # [T, H]
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8 / bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


# --------------------------------------------------------------------------- storage dtypes


def storage_dtype_name(setting: str, compute_dtype: str) -> str:
    """The dtype the states are stored in, from ``extract.storage_dtype`` ("compute": as
    computed)."""
    return compute_dtype if setting == "compute" else setting


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the last axis -> (float8 values, float32 scale per row), on x's device; a row of
    zeros gets scale 1."""
    values = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    for a in range(0, x.shape[0], ENCODE_CHUNK_ROWS):
        chunk = x[a : a + ENCODE_CHUNK_ROWS].float()
        amax = chunk.abs().amax(-1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scales[a : a + ENCODE_CHUNK_ROWS] = scale
        values[a : a + ENCODE_CHUNK_ROWS] = (chunk / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return values, scales


def encode_states(
    aux: torch.Tensor, final: torch.Tensor, storage: torch.dtype
) -> dict[str, torch.Tensor]:
    """A sample's rows as the shard stores them (tensor name -> tensor, on the input's device)."""
    if storage != FP8:
        return {"aux_hidden_states": aux.to(storage), "final_hidden_states": final.to(storage)}
    aux_values, aux_scales = fp8_encode(aux)
    final_values, final_scales = fp8_encode(final)
    return {
        "aux_hidden_states": aux_values,
        "aux_scales": aux_scales,
        "final_hidden_states": final_values,
        "final_scales": final_scales,
    }


def decode(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Stored rows -> their values: as stored, or float32 for float8 (values x scale)."""
    return values if scales is None else values.float() * scales.unsqueeze(-1)


def read_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """The positions of a sample whose final state training reads: j where token j+1 is an
    assistant token (the loss of the token at j+1 has the verifier's state at j as teacher)."""
    return torch.nonzero(loss_mask[1:].bool()).flatten()


def read_runs(loss_mask: torch.Tensor) -> list[list[int]]:
    """``read_positions`` as [start, end) runs (an assistant turn is one run)."""
    pos = read_positions(loss_mask).tolist()
    runs: list[list[int]] = []
    for j in pos:
        if runs and runs[-1][1] == j:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1])
    return runs


def select_rows(x: torch.Tensor, runs: list[list[int]]) -> torch.Tensor:
    """The rows of x in the runs, in order, on x's device."""
    if not runs:
        return x[:0]
    return torch.cat([x[a:b] for a, b in runs])


def shard_fingerprint(path: Path) -> str | None:
    """The fingerprint a finished shard was written with, or None if unreadable/absent."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return (fh.metadata() or {}).get("fingerprint")
    except Exception:
        return None


class ShardReader:
    """Memory-mapped access to one shard's samples; tensors are read only when asked for,
    float8 states decoded to float32, and the final states placed at their positions."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh = safe_open(str(self.path), framework="pt")
        names = set(self._fh.keys())
        self.offsets = self._fh.get_tensor("sample_offsets")
        self.final_offsets = (
            self._fh.get_tensor("final_offsets") if "final_offsets" in names else None
        )
        self.scaled = "aux_scales" in names

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def storage_dtype(self) -> str:
        return self._fh.get_slice("aux_hidden_states").get_dtype()

    def _rows(self, name: str, a: int, b: int) -> torch.Tensor:
        values = self._fh.get_slice(f"{name}_hidden_states")[a:b]
        return decode(values, self._fh.get_slice(f"{name}_scales")[a:b] if self.scaled else None)

    def sample(self, i: int, max_tokens: int | None = None) -> SampleStates:
        """Sample ``i`` (its first ``max_tokens`` tokens, if given)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        n = b - a if max_tokens is None else min(b - a, max_tokens)
        loss_mask = self._fh.get_slice("loss_mask")[a:b]
        if self.final_offsets is None:
            final = self._rows("final", a, a + n)
        else:
            positions = read_positions(loss_mask)
            keep = int((positions < n).sum())  # ascending: the first ``keep`` rows
            first = int(self.final_offsets[i])
            rows = self._rows("final", first, first + keep)
            final = rows.new_zeros(n, rows.shape[-1])
            final[positions[:keep]] = rows
        return SampleStates(
            aux_hidden_states=self._rows("aux", a, a + n),
            final_hidden_states=final,
            input_ids=self._fh.get_slice("input_ids")[a : a + n],
            loss_mask=loss_mask[:n],
        )

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


@dataclass
class Layout:
    """Where each tensor of a shard lies: its safetensors header, each tensor's first byte
    (from the start of the data), and the bytes of one row (token, or final row) of each."""

    header: bytes
    begin: dict[str, int]
    row_bytes: dict[str, int]
    data_bytes: int

    @property
    def data_start(self) -> int:
        return 8 + len(self.header)

    @property
    def file_bytes(self) -> int:
        return self.data_start + self.data_bytes


def shard_layout(
    num_samples: int,
    num_tokens: int,
    num_final_rows: int,
    num_aux_layers: int,
    hidden_size: int,
    storage: torch.dtype,
    metadata: dict[str, str],
) -> Layout:
    """The layout of a shard: the offsets and ``input_ids`` (8-byte aligned first), the float8
    scales if any (4-byte), ``aux_hidden_states``, ``final_hidden_states``, ``loss_mask``.
    ``file_bytes`` is the exact size of the file."""
    T, F = num_tokens, num_final_rows
    rows: list[tuple[str, torch.dtype, int, list[int]]] = [
        ("sample_offsets", torch.int64, num_samples + 1, []),
        ("final_offsets", torch.int64, num_samples + 1, []),
        ("input_ids", torch.int64, T, []),
    ]
    if storage == FP8:
        rows += [
            ("aux_scales", torch.float32, T, [num_aux_layers]),
            ("final_scales", torch.float32, F, []),
        ]
    rows += [
        ("aux_hidden_states", storage, T, [num_aux_layers, hidden_size]),
        ("final_hidden_states", storage, F, [hidden_size]),
        ("loss_mask", torch.uint8, T, []),
    ]
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    begin: dict[str, int] = {}
    row_bytes: dict[str, int] = {}
    pos = 0
    for name, dt, count, row in rows:
        size = torch.empty((), dtype=dt).element_size()
        for d in row:
            size *= d
        row_bytes[name] = size
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dt],
            "shape": [count, *row],
            "data_offsets": [pos, pos + count * size],
        }
        begin[name] = pos
        pos += count * size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return Layout(raw, begin, row_bytes, pos)
