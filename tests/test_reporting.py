"""Training curves in TensorBoard and Weights & Biases (train.report_to): a short real training on
the tiny inputs tests/test_train.py trains on, killed after its first checkpoint and resumed; the
curves read back with TensorBoard's own reader and from W&B's offline run are metrics.jsonl's,
each step once; the settings plan nothing; an unknown or missing backend is refused at validation,
naming the key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.train_data_for_tests import build_inputs, read_metrics
from tests.workflow_runner import planned_in_process
from workflow_scripts.lib.training import reporting, trainer
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.config import ConfigError, load_config
from workflow_scripts.lib.workflow.layout import METRICS
from workflow_scripts.stages import train

ROOT = Path(__file__).resolve().parents[1]
BOTH = ["tensorboard", "wandb"]
PARAMS = dict(
    epochs=3,
    micro_batch_budget_tokens=128,
    learning_rate=3e-3,
    warmup_steps=5,
    validation_fraction=0.1,
    validate_every_steps=8,
    checkpoint_every_steps=10,
    report_to=BOTH,
)


def job_env(home: Path) -> dict[str, str]:
    """The environment of a user who has not configured W&B (no mode, no key, no login), W&B's
    own directories in ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return env | {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "NETRC": str(home / "netrc"),  # none: no `wandb login`
        "WANDB_DIR": str(home / "dir"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
    }


def run_python(args: list[str], home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python *args`` from the repository, in ``job_env(home)``, to its end."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=job_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A 4-layer random verifier, 64 samples in 4 shards, a 64-token draft vocabulary."""
    return build_inputs(tmp_path_factory.mktemp("report_inputs"))


@pytest.fixture(scope="module")
def resumed(inputs, tmp_path_factory):
    """One training with both backends, SIGKILLed once its first state is saved and run again:
    (its train directory, its run id, the resumed job's stderr)."""
    root = tmp_path_factory.mktemp("reporting")
    out = root / "results" / "train"
    args = inputs.args(out, **PARAMS)
    command = [sys.executable, "-m", "workflow_scripts.stages.train", *args]
    env = job_env(root / "wandb_home")
    state = out / "state" / trainer.STATE_FILE
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 180
    while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = torch.load(state, weights_only=False)
    assert saved["step"] > 0 and not (out / "draft").exists(), "the run ended before the kill"
    again = run_python(command[1:], root / "wandb_home")
    assert again.returncode == 0, again.stderr[-5000:]
    assert f"resumed from {state} at step {saved['step']}" in again.stderr
    return out, saved["report_run"], again.stderr


def tensorboard_curve(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def wandb_history(out: Path, run_id: str) -> list[dict]:
    """Every history row W&B holds of the run, over its offline directories (one per process,
    in the order ``wandb sync`` uploads them: of their start times)."""
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    return [
        reporting.items(record.history.item)
        for run in runs
        for record in reporting.wandb_records(run / f"run-{run_id}.wandb")
        if record.HasField("history")
    ]


def test_the_backends_show_the_curves_of_the_metrics_file(resumed):
    out, run_id, _ = resumed
    rows = read_metrics(out / METRICS)
    validation = read_metrics(out / METRICS, "val")
    assert validation and rows
    # TensorBoard: one run, its curves those of metrics.jsonl, at the optimizer steps
    assert [p.name for p in (out / "tensorboard").iterdir()] == [run_id]
    events = out / "tensorboard" / run_id
    for tag, field, split in [
        ("train/loss", "loss", rows),
        ("train/lr", "lr", rows),
        ("train/tokens_per_s", "tokens_per_s", rows),
        ("val/loss", "loss", validation),
        ("val/simulated_acceptance_length", "simulated_acceptance_length", validation),
    ]:
        curve = tensorboard_curve(events, tag)
        assert [s for s, _ in curve] == [r["step"] for r in split], tag
        assert [v for _, v in curve] == pytest.approx([r[field] for r in split], rel=1e-6), tag
    third = tensorboard_curve(events, "train/top1_agreement/3")
    assert [v for _, v in third] == pytest.approx([r["top1_agreement"][2] for r in rows], abs=1e-6)
    # W&B: the same rows, by step (training's and validation's of a step in one row)
    history = {h["_step"]: h for h in wandb_history(out, run_id)}
    assert sorted(history) == [r["step"] for r in rows]
    for r in rows:
        assert history[r["step"]]["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert history[r["step"]]["train/acceptance_per_position/1"] == pytest.approx(
            r["acceptance_per_position"][0], abs=1e-6
        )
    for v in validation:
        assert history[v["step"]]["val/loss"] == pytest.approx(v["loss"], rel=1e-6)
    # the validation whose weights the draft has, in the run's summary
    selected = read_metrics(out / METRICS, "selected")[-1]
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    summary = {}
    for record in reporting.wandb_records(runs[-1] / f"run-{run_id}.wandb"):
        if record.HasField("summary"):
            summary |= reporting.items(record.summary.update)
    assert summary["selected/loss"] == pytest.approx(selected["loss"], rel=1e-6)
    # the files are the results', none in the state directory
    assert not {"tensorboard", "wandb"} & {p.name for p in (out / "state").iterdir()}


def test_a_resumed_run_continues_its_curves_each_step_once(resumed):
    out, run_id, stderr = resumed
    steps = [r["step"] for r in read_metrics(out / METRICS)]
    assert steps == list(range(1, len(steps) + 1))
    # TensorBoard: the killed process's steps past the state purged, logged again once
    assert [s for s, _ in tensorboard_curve(out / "tensorboard" / run_id, "train/loss")] == steps
    # W&B: one run, a directory per process, every step once over both
    assert len(sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
    assert [h["_step"] for h in wandb_history(out, run_id)] == steps
    # offline (nothing configured): where its files are and how to upload them, in the log
    assert f"W&B run {run_id} (id {run_id}, project results) offline" in stderr
    assert f"wandb sync {out / 'wandb'}/offline-run-*-{run_id}" in stderr
    assert f"TensorBoard event files in {out / 'tensorboard' / run_id}" in stderr


def test_under_torchrun_the_main_process_reports(inputs, tmp_path):
    out = tmp_path / "results" / "train"
    params = {**PARAMS, "epochs": 1, "num_cpu_processes": 2}
    args = inputs.args(out, **params)
    proc = run_python(["-m", "workflow_scripts.stages.train", *args], tmp_path / "wandb_home")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "starting 2 training processes" in proc.stderr
    steps = [r["step"] for r in read_metrics(out / METRICS)]
    (events,) = (out / "tensorboard").iterdir()
    assert [s for s, _ in tensorboard_curve(events, "train/loss")] == steps
    assert [h["_step"] for h in wandb_history(out, events.name)] == steps


WANDB_RESUMED = """
import sys, time
from pathlib import Path
import wandb
from workflow_scripts.lib.training.reporting import Reporter
from workflow_scripts.lib.workflow.definitions import TrainParams
from workflow_scripts.lib.workflow.records import MetricsRow

root, first = Path(sys.argv[1]), int(sys.argv[2])
run = wandb.init(project="p", id="r1", dir=root, mode="offline")  # the killed process's steps
for step in range(1, first + 1):
    run.log({"train/loss": 1 / step}, step=step)
run.finish()
time.sleep(1.1)  # (W&B names a run's directory after the second it starts in)
def row(step):
    return MetricsRow(
        step=step, split="train", loss=1 / step, kl_per_step=[], top1_agreement=[],
        top1_agreement_full_vocab=[], acceptance_per_position=[], simulated_acceptance_length=1,
        positions_per_step=[],
    )
rows = [row(step) for step in range(1, 11)]
report = Reporter(TrainParams(report_to=["wandb"]), root, "r1", 10, rows)  # resumed at 10
for step in range(11, 21):
    report.log(row(step))
report.close(True)
"""


@pytest.mark.parametrize("first", [15, 4])
def test_wandb_is_sent_each_step_its_files_lack(tmp_path, first):
    """Offline, a killed process's W&B files hold the steps it wrote before the kill: past the
    state the run resumes from (15, the state at 10), or fewer (4: W&B writes its files in
    blocks). The resumed run sends each step they lack, once."""
    proc = run_python(
        ["-c", WANDB_RESUMED, str(tmp_path), str(first)], tmp_path / "wandb_home", 300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = wandb_history(tmp_path, "r1")
    assert [h["_step"] for h in history] == list(range(1, 21))
    assert [h["train/loss"] for h in history] == pytest.approx([1 / s for s in range(1, 21)])


@pytest.mark.parametrize("name", ["2026", "null", "true", "curves of 2026"])
def test_a_wandb_name_reaches_the_job_as_written(inputs, tmp_path, name):
    """The job reads the names the config gives, also those that read as JSON."""
    args = inputs.args(tmp_path, report_to=["wandb"], wandb_project=name, wandb_run_name=name)
    _, params = cli.parse("train", args)
    assert (params.wandb_project, params.wandb_run_name) == (name, name)


def test_the_report_settings_plan_nothing(mechanics_build):
    work, config = mechanics_build
    changed = {
        **config,
        "train": {
            **config.get("train", {}),
            "report_to": BOTH,
            "wandb_project": "curves",
            "wandb_run_name": "first",
        },
    }
    assert planned_in_process(work, "evaluate", changed) == {}


def shipped_with(**train_settings) -> dict:
    shipped = yaml.safe_load((ROOT / "config.yaml").read_text())
    return {**shipped, "train": {**shipped.get("train", {}), **train_settings}}


def test_an_unknown_backend_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"'train\.report_to\[1\]' = 'tensorbord'.*'wandb'"):
        load_config(shipped_with(report_to=["wandb", "tensorbord"]))
    with pytest.raises(ConfigError, match=r"train\.report_to lists wandb twice"):
        load_config(shipped_with(report_to=["wandb", "wandb"]))


def test_a_backend_not_installed_is_refused_at_validation_and_in_the_job(
    inputs, tmp_path, monkeypatch, capsys
):
    args = inputs.args(tmp_path / "out", report_to=["wandb"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # what cannot be imported
    with pytest.raises(ConfigError, match=r"train\.report_to lists wandb.*pip install wandb"):
        load_config(shipped_with(report_to=["wandb"]))
    with pytest.raises(SystemExit) as stopped:
        train.main(args)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "--report-to" in error and "pip install wandb" in error
    assert not (tmp_path / "out").exists()
