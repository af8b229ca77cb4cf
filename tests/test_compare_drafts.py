"""benchmarks/compare_drafts.py on the benchmarks' kept records: each side's pooled acceptance is
what the evaluation's own counters gave, the difference is paired over the same prompts, overall
and per set, and runs evaluated otherwise are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "compare_drafts.py"
KEPT = ROOT / "benchmarks" / "results"

sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_drafts import compare, load  # noqa: E402


def kept(bench: str, variant: str, seeds=(0,)) -> list[dict]:
    return [load(KEPT / bench / f"{variant}@{s}.json") for s in seeds]


@pytest.mark.parametrize("bench, new, old", [("quality", "warm_start", "baseline"),
                                             ("real", "eagle3.1_norms", "baseline")])  # fmt: skip
def test_one_seed_a_side_is_the_evaluations_own_acceptance(bench, new, old):
    a, b = kept(bench, new), kept(bench, old)
    result = compare(a, b)
    for side, runs in (("new", a), ("against", b)):
        assert result[side]["pooled"] == pytest.approx(
            runs[0]["summary"]["eagle3_mean_acceptance_length"], abs=1e-9
        )
    assert result["difference"] == pytest.approx(
        result["new"]["pooled"] - result["against"]["pooled"]
    )
    low, high = result["ci95"]
    assert low < result["difference"] < high
    assert sum(s["prompts"] for s in result["sets"].values()) == result["num_prompts"]


def test_seeds_pool_and_their_range_sets_the_noise():
    result = compare(kept("quality", "warm_start", range(3)), kept("quality", "baseline", range(3)))
    assert len(result["new"]["seeds"]) == 3
    assert min(result["new"]["seeds"]) <= result["new"]["pooled"] <= max(result["new"]["seeds"])
    noise = max(result["new"]["range"], result["against"]["range"])
    outside = result["ci95"][0] > 0 or result["ci95"][1] < 0
    assert result["beyond_noise"] == (outside and abs(result["difference"]) > noise)


def test_runs_evaluated_otherwise_are_refused():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(KEPT / "quality" / "baseline@0.json"), "--against",
         str(KEPT / "real" / "baseline@0.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "not evaluated alike" in proc.stderr
