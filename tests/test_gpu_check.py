"""benchmarks/gpu_check.sh's bounds and its one file, without a GPU: a command past its part's
time is stopped with the processes it started, a part left without time is reported as such, and
a failure is reported with its cause; and the check a lent GPU machine runs (no vLLM there), in its
small form on the CPU within its time. (`GPU_CHECK_SMALL=1 benchmarks/gpu_check.sh` runs every
part on the CPU, the engine's too; minutes, so not in the suite.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def running(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def test_a_command_past_its_time_is_stopped_with_what_it_started(gpu_check, tmp_path):
    check = gpu_check.Check(tmp_path / "out", True, time.time() + 60, "")
    (tmp_path / "out").mkdir()
    pidfile = tmp_path / "child.pid"
    check.part_deadline = time.time() + 1
    start = time.monotonic()
    with pytest.raises(gpu_check.TimeUp, match="stopped after"):
        check.sh(["bash", "-c", f"sleep 120 & echo $! > {pidfile}; wait"], "sleeper")
    assert time.monotonic() - start < 15
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child), "the command's child outlived its time"
    assert "===== sleeper: bash -c" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_a_failure_names_its_cause_before_the_launchers_report(gpu_check):
    noise = [f'  File "/x/torch/distributed/run.py", line {i}' for i in range(40)]
    text = "\n".join(["loading", "UserError: train.num_gpus 2 but the job sees 1", *noise])
    assert "UserError: train.num_gpus 2" in gpu_check.tail(text)


def test_parts_without_time_are_reported_in_the_one_file(gpu_check, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "run", str(out), "--small", "--deadline", str(time.time()),
         "--install", "as given"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # nothing passed
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["state"] == "finished" and report["install"] == "as given"
    assert report["environment"]["versions"]["torch"]
    assert [p["name"] for p in report["parts"]] == [p.name for p in gpu_check.PARTS]
    for part in report["parts"]:
        assert part["status"] == "not_run" and part["reason"].startswith("out of time"), part
    assert report["summary"] == {"not_run": len(gpu_check.PARTS)}


# The lent machine's check, small, on this CPU: its limit when it is run this way (about 90 s
# alone on 2 cores; the suite runs it beside its builds and the lanes, tests/lanes.py).
LENT_SMALL_LIMIT_S = 600


@pytest.mark.slow
def test_the_lent_machines_check_passes_small_on_the_cpu_within_its_limit(gpu_check, tmp_path):
    """Every part a lent machine runs (its image has no vLLM) passes in its small form, with its
    figures in the one file; the engine parts are reported as skipped, saying why."""
    out = tmp_path / "out"
    deadline = time.time() + LENT_SMALL_LIMIT_S
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "run", str(out), "--small", "--lent", "--deadline",
         str(deadline)],
        capture_output=True, text=True, timeout=LENT_SMALL_LIMIT_S + 60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    parts = {p["name"]: p for p in report["parts"]}
    engine = {p.name for p in gpu_check.PARTS if p.engine}
    for name, part in parts.items():
        if name in engine:
            assert part["status"] == "skipped" and "--lent" in part["reason"], part
        else:
            assert part["status"] == "pass", part
    assert parts["train_torchrun"]["figures"]["loss_fell"]
    extract = parts["extract_transformers"]["figures"]
    assert extract["extract_tokens_per_s"] > 0 and extract["extract_over_prefill"] > 0
    assert report["wall_s"] <= LENT_SMALL_LIMIT_S
