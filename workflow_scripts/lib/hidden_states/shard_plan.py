"""What an extraction engine is given to compute: each shard's samples (lines of
tokenized_data.jsonl, read and checked here), the metadata and exact size of its file, and its
fingerprint, the key a finished shard is reused by. The plan is made (and checked) by
``extraction.py``; the engines (``extract_engines.py``) import only this module of it, so the code
that computes shards, which every shard's fingerprint holds, is not the code that plans, checks,
merges or records them: an edit there reuses every shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.hidden_states.shard_format import FORMAT_VERSION, LAYER_CONVENTION
from workflow_scripts.lib.hidden_states.shards import TORCH_DTYPES, shard_layout
from workflow_scripts.lib.workflow.code_inputs import resume_key

# --------------------------------------------------------------------------- samples


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
    rows_sha256: str = ""  # what its samples' bytes are known by (see ``fingerprint``)
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
    key: dict[str, Any]  # what every shard depends on (its fingerprint, with its own samples)
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
    and its samples: their range, the ones skipped, and their bytes (``rows_sha256``: the sha256
    of the shard's lines of tokenized data; for a held-out shard, of the fingerprints of the shards
    its samples come from)."""
    what = {k: v for k, v in common_key.items() if k != "code"}
    return resume_key(
        {
            **what,
            "sample_range": [shard.start, shard.end],
            "skipped": shard.skipped,
            "rows_sha256": shard.rows_sha256,
        },
        common_key["code"],
    )
