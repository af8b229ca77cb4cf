"""vocab: tokenized data -> the draft vocabulary map.

Counts loss-masked tokens only, keeps the ``draft_vocab_size`` most frequent (ties broken by the
lower token id; tokens never seen fill up by lowest id), sorted by token id, and writes:

* ``d2t`` int64 [K]: offsets, target id = i + d2t[i] (what vLLM reads),
* ``t2d`` bool [V]: which verifier tokens are in the draft vocabulary,
* ``token_counts`` int64 [V]: the loss-masked counts the choice was made from.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch
from safetensors.torch import save_file

from workflow_scripts import cli
from workflow_scripts.common import UserError, atomic_path, run_main, verifier_config, write_json

log = logging.getLogger("eagle3")


def count_masked_tokens(path, vocab_size: int) -> tuple[np.ndarray, int]:
    counts = np.zeros(vocab_size, dtype=np.int64)
    rows = 0
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            row = json.loads(line)
            ids = np.asarray(row["input_ids"], dtype=np.int64)
            mask = np.asarray(row["loss_mask"], dtype=bool)
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


def build_maps(selected: np.ndarray, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = torch.from_numpy(selected - np.arange(selected.size)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(selected)] = True
    return d2t, t2d


def main() -> None:
    io, p = cli.parse("vocab")
    vocab_size = int(verifier_config(io.verifier)["vocab_size"])
    k = p.draft_vocab_size
    if k > vocab_size:
        log.warning(
            "vocab.draft_vocab_size %d exceeds the verifier's vocabulary (%d): using %d",
            k,
            vocab_size,
            vocab_size,
        )
        k = vocab_size
    counts, rows = count_masked_tokens(io.tokenized, vocab_size)
    if rows == 0:
        raise UserError(f"{io.tokenized} is empty: nothing to count")
    selected = select_vocab(counts, k)
    d2t, t2d = build_maps(selected, vocab_size)
    total = int(counts.sum())
    covered = int(counts[selected].sum())
    with atomic_path(io.vocab_map) as tmp:
        save_file(
            {"d2t": d2t, "t2d": t2d, "token_counts": torch.from_numpy(counts)},
            str(tmp),
            metadata={"draft_vocab_size": str(k), "verifier_vocab_size": str(vocab_size)},
        )
    stats = {
        "rows": rows,
        "verifier_vocab_size": vocab_size,
        "draft_vocab_size": k,
        "requested_draft_vocab_size": p.draft_vocab_size,
        "loss_masked_tokens": total,
        "distinct_loss_masked_tokens": int((counts > 0).sum()),
        "coverage": covered / total if total else 0.0,
    }
    write_json(io.stats, stats)
    log.info("vocab: done: %s", json.dumps(stats))


if __name__ == "__main__":
    run_main(main)
