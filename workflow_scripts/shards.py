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
layers, dtype, sample range) and ``sample_start``. A manifest (JSON) lists the shards with sample
and token counts and a sha256 each, plus the layer ids, convention, dtype and verifier identity;
downstream rules depend on the manifest only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workflow_scripts.common import UserError, atomic_path, sha256_file

FORMAT_VERSION = 1
LAYER_CONVENTION = (
    "vllm: aux id k is the input of decoder layer k (HF hidden_states[k]); "
    "final_hidden_states is the output of the last layer before the final norm"
)
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


def shard_name(index: int) -> str:
    return f"shard_{index:06d}.safetensors"


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


def load_manifest(path: Path, verify_checksums: bool = False) -> dict[str, Any]:
    """Read a manifest, check every shard exists (and its checksum, if asked); shard paths in
    the result are absolute."""
    path = Path(path)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read extraction manifest {path}: {exc}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path}: format_version {manifest.get('format_version')!r}, expected "
            f"{FORMAT_VERSION}; rerun extraction"
        )
    base = path.parent
    for entry in manifest["shards"]:
        shard = (base / entry["file"]).resolve()
        entry["path"] = str(shard)
        if not shard.is_file():
            raise UserError(f"{path}: shard {shard} is missing; rerun extraction")
        if verify_checksums and sha256_file(shard) != entry["sha256"]:
            raise UserError(
                f"{path}: shard {shard} does not match its checksum (corrupt or overwritten); "
                "delete it and rerun extraction"
            )
    return manifest
