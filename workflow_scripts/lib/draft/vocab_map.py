"""The draft vocabulary map: the ``draft_vocab_size`` most frequent loss-masked tokens.

Counts loss-masked tokens only, keeps the most frequent (ties broken by the lower token id;
tokens never seen fill up by lowest id), sorted by token id. The map file (safetensors) holds:

* ``d2t`` int64 [K]: offsets, target id = i + d2t[i] (what vLLM reads),
* ``t2d`` bool [V]: which verifier tokens are in the draft vocabulary,
* ``token_counts`` int64 [V]: the loss-masked counts the choice was made from.

numpy only (no torch): the vocab job is small and starts fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from workflow_scripts.lib.common import UserError, atomic_path


def count_masked_tokens(path, vocab_size: int) -> tuple[np.ndarray, int]:
    counts = np.zeros(vocab_size, dtype=np.int64)
    rows = 0
    with open(path, "rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            try:
                row = json.loads(line)
                ids = np.asarray(row["input_ids"], dtype=np.int64)
                mask = np.asarray(row["loss_mask"], dtype=bool)
                if ids.shape != mask.shape or ids.ndim != 1:
                    raise ValueError("input_ids and loss_mask differ in length")
            except (ValueError, TypeError, KeyError) as exc:  # JSON and Unicode errors too
                raise UserError(
                    f"{path}:{line_no}: not a tokenized row ({exc!r}); rerun the prepare stage"
                ) from None
            if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
                raise UserError(
                    f"{path}:{line_no}: token id {int(ids.max())} is outside the verifier's "
                    f"vocabulary of {vocab_size}; was it tokenized for another verifier?"
                )
            counts += np.bincount(ids[mask], minlength=vocab_size)
            rows += 1
    return counts, rows


def select_vocab(counts: np.ndarray, k: int) -> np.ndarray:
    """Token ids of the draft vocabulary: top-k by count, ties to the lower id, sorted by id."""
    order = np.lexsort((np.arange(counts.size), -counts))  # primary: -count, then id
    return np.sort(order[:k])


def build_maps(selected: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [K], t2d bool [V]) for the selected token ids (ascending)."""
    d2t = (selected - np.arange(selected.size)).astype(np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[selected] = True
    return d2t, t2d


def write_vocab_map(path: Path | str, counts: np.ndarray, k: int) -> dict[str, float | int]:
    """Selects the draft vocabulary of ``k`` tokens from ``counts`` and writes the map file
    atomically; returns how much of the counted tokens it covers."""
    vocab_size = counts.size
    selected = select_vocab(counts, k)
    d2t, t2d = build_maps(selected, vocab_size)
    # one metadata entry: safetensors writes its metadata map in an order that changes from one
    # process to the next, and the same map must be the same bytes (training's fingerprint and
    # Snakemake's checksums compare bytes)
    sizes = json.dumps({"draft_vocab_size": k, "verifier_vocab_size": vocab_size})
    with atomic_path(path) as tmp:
        save_file(
            {"d2t": d2t, "t2d": t2d, "token_counts": counts.astype(np.int64)},
            str(tmp),
            metadata={"sizes": sizes},
        )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates its file readable by the owner only
    total = int(counts.sum())
    covered = int(counts[selected].sum())
    return {
        "loss_masked_tokens": total,
        "distinct_loss_masked_tokens": int((counts > 0).sum()),
        "coverage": covered / total if total else 0.0,
    }
