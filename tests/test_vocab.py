"""vocab: loss-masked counts -> d2t / t2d, deterministic, clamped to the verifier vocabulary."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from workflow_scripts.lib.draft.vocab_map import select_vocab
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.definitions import VocabParams
from workflow_scripts.lib.workflow.layout import STATS

ROOT = Path(__file__).resolve().parents[1]


def test_top_k_ties_go_to_lower_id_and_result_is_sorted():
    counts = np.array([0, 5, 3, 5, 3, 9, 0])
    assert select_vocab(counts, 3).tolist() == [1, 3, 5]
    assert select_vocab(counts, 4).tolist() == [1, 2, 3, 5]  # 2 beats 4 on the tie at 3
    assert select_vocab(counts, 6).tolist() == [0, 1, 2, 3, 4, 5]  # unseen fill by lowest id


def run_vocab(tmp_path, rows, vocab_size, draft_vocab_size):
    verifier = tmp_path / "verifier"
    verifier.mkdir(exist_ok=True)
    (verifier / "config.json").write_text(
        json.dumps({"hidden_size": 8, "num_hidden_layers": 4, "vocab_size": vocab_size})
    )
    tokenized = tmp_path / "tokenized_data.jsonl"
    tokenized.write_text("".join(json.dumps(r) + "\n" for r in rows))
    files = {
        "tokenized": tokenized,
        "verifier": verifier,
        "vocab_map": tmp_path / "out" / "vocab_map.safetensors",
        "stats": tmp_path / "out" / STATS,
    }
    args = shlex.split(cli.render("vocab", VocabParams(draft_vocab_size=draft_vocab_size), files))
    proc = subprocess.run(
        [sys.executable, "-m", "workflow_scripts.stages.vocab", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return proc, files


ROWS = [
    # token 7 appears often but only outside the loss mask: it must not be chosen
    {"id": "a", "input_ids": [7, 7, 7, 7, 3, 3, 9], "loss_mask": [0, 0, 0, 0, 1, 1, 1]},
    {"id": "b", "input_ids": [7, 7, 1, 3, 9, 9, 2], "loss_mask": [0, 0, 1, 1, 1, 1, 1]},
]


def test_maps_from_masked_tokens_only(tmp_path):
    proc, files = run_vocab(tmp_path, ROWS, vocab_size=12, draft_vocab_size=3)
    assert proc.returncode == 0, proc.stderr
    maps = load_file(files["vocab_map"])
    # masked counts: 3 -> 3, 9 -> 3, 1 -> 1, 2 -> 1; top 3 = {3, 9} + 1 (tie with 2: lower id)
    target_ids = torch.arange(3) + maps["d2t"]
    assert target_ids.tolist() == [1, 3, 9]
    assert maps["d2t"].dtype == torch.int64 and maps["t2d"].dtype == torch.bool
    assert maps["t2d"].shape == (12,) and maps["t2d"].nonzero().flatten().tolist() == [1, 3, 9]
    assert maps["token_counts"][7] == 0 and maps["token_counts"][3] == 3
    stats = json.loads(files["stats"].read_text())
    assert stats["loss_masked_tokens"] == 8 and stats["coverage"] == pytest.approx(7 / 8)


def test_draft_vocab_clamped_to_verifier_with_warning(tmp_path):
    proc, files = run_vocab(tmp_path, ROWS, vocab_size=12, draft_vocab_size=100)
    assert proc.returncode == 0, proc.stderr
    assert "exceeds the verifier's vocabulary (12): using 12" in proc.stderr
    maps = load_file(files["vocab_map"])
    assert maps["d2t"].tolist() == [0] * 12 and bool(maps["t2d"].all())


def test_token_outside_verifier_vocab_is_an_error(tmp_path):
    proc, files = run_vocab(tmp_path, ROWS, vocab_size=8, draft_vocab_size=4)
    assert proc.returncode == 2 and "outside the verifier's vocabulary of 8" in proc.stderr
    assert not files["vocab_map"].exists()


def test_deterministic_to_the_byte(tmp_path):
    outputs = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        outputs.append(run_vocab(tmp_path / name, ROWS, 12, 5)[1])
    first, second = outputs
    a, b = load_file(first["vocab_map"]), load_file(second["vocab_map"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the same bytes, from two processes: training's fingerprint and Snakemake's checksums
    # compare bytes (a metadata map of several entries came out in another order each time)
    assert Path(first["vocab_map"]).read_bytes() == Path(second["vocab_map"]).read_bytes()
    assert Path(first["vocab_map"]).stat().st_mode & 0o044  # readable beyond the owner
