"""workflow_scripts/lib/workflow/gpus.py: each local GPU job gets GPUs of its own; SLURM's
allocation is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import workflow_runner
from workflow_scripts.lib.workflow.layout import Layout

ROOT = Path(__file__).resolve().parents[1]


def launch(n, command, env_extra, lock_dir, **kwargs):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    env.update({"EAGLE3_GPU_LOCK_DIR": str(lock_dir), **env_extra})
    return subprocess.Popen(
        [sys.executable, "-m", "workflow_scripts.lib.workflow.gpus", str(n), "--", *command],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def fake_nvidia_smi(tmp_path: Path, count: int) -> dict:
    """A PATH whose nvidia-smi lists ``count`` GPUs like the real `nvidia-smi -L`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    lines = "\n".join(
        f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d}-0000-0000-0000-000000000000)"
        for i in range(count)
    )
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\n[ "$1" = -L ] || exit 9\ncat <<"EOF"\n{lines}\nEOF\n')
    exe.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


SHOW_AND_HOLD = ["sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"; exec sleep "$0"']


def visible(proc) -> list[str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out.strip().split(",")


def test_two_concurrent_4_gpu_jobs_on_8_gpus_get_disjoint_gpus(tmp_path):
    env = fake_nvidia_smi(tmp_path, 8)
    first = launch(4, [*SHOW_AND_HOLD, "3"], env, tmp_path / "locks")
    time.sleep(1.0)  # first holds its lease while the second starts
    second = launch(4, [*SHOW_AND_HOLD, "0"], env, tmp_path / "locks")
    a, b = visible(first), visible(second)
    assert len(a) == len(b) == 4
    assert not set(a) & set(b), (a, b)
    assert sorted(a + b, key=int) == [str(i) for i in range(8)]


def test_many_concurrent_jobs_never_share_a_gpu(tmp_path):
    """Eight 1-GPU and 2-GPU jobs started at once on 8 GPUs: at no time do two share a GPU."""
    env = fake_nvidia_smi(tmp_path, 8)
    record = tmp_path / "record"
    record.mkdir()
    script = (
        'f="$0/$$"; echo "$CUDA_VISIBLE_DEVICES" > "$f.start"; sleep 1; '
        'echo "$CUDA_VISIBLE_DEVICES" > "$f.end"'
    )
    procs = [
        launch(1 + i % 2, ["sh", "-c", script, str(record)], env, tmp_path / "locks")
        for i in range(8)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    # 12 GPUs asked of 8: some jobs waited. Reconstruct who held which GPU when.
    spans = []
    for start in record.glob("*.start"):
        end = start.with_suffix(".end")
        ids = start.read_text().strip().split(",")
        assert end.read_text().strip() == ",".join(ids)
        spans.append((start.stat().st_mtime, end.stat().st_mtime, set(ids)))
    assert len(spans) == 8
    for i, (s1, e1, g1) in enumerate(spans):
        for s2, e2, g2 in spans[i + 1 :]:
            if s1 < e2 and s2 < e1:  # overlapping in time
                assert not g1 & g2


def test_a_lease_ends_with_the_job_even_when_it_is_killed(tmp_path):
    env = fake_nvidia_smi(tmp_path, 4)
    holder = launch(4, [*SHOW_AND_HOLD, "60"], env, tmp_path / "locks")
    assert holder.stdout.readline().strip() == "0,1,2,3"
    waiter = launch(2, [*SHOW_AND_HOLD, "0"], env, tmp_path / "locks")
    time.sleep(1.5)
    assert waiter.poll() is None  # waits: all four GPUs are leased
    holder.kill()  # no cleanup runs: the kernel drops the locks
    holder.communicate()
    assert visible(waiter) == ["0", "1"]


def test_fewer_gpus_than_asked_fails_before_the_command_runs(tmp_path):
    marker = tmp_path / "ran"
    proc = launch(4, ["touch", str(marker)], fake_nvidia_smi(tmp_path, 2), tmp_path / "locks")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert not marker.exists()
    assert "needs 4 GPU(s), found 2 (0,1) in nvidia-smi -L" in err


def test_no_nvidia_smi_means_no_gpu(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = launch(1, ["true"], {"PATH": str(empty)}, tmp_path / "locks")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "nvidia-smi is not installed" in err


def test_the_callers_cuda_visible_devices_is_the_pool(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "5,7"}
    assert visible(launch(2, [*SHOW_AND_HOLD, "0"], env, tmp_path / "locks")) == ["5", "7"]
    proc = launch(3, ["true"], env, tmp_path / "locks")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "found 2 (5,7) in CUDA_VISIBLE_DEVICES" in err


def test_zero_gpus_runs_the_command_unchanged(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "3", "PATH": "/usr/bin:/bin"}  # no nvidia-smi needed
    proc = launch(0, ["sh", "-c", 'echo "${CUDA_VISIBLE_DEVICES-unset}"; exit 7'], env, tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7  # the command's own status
    assert out.strip() == "3"
    assert not (tmp_path / "gpu-3.lock").exists()


def test_slurm_allocation_is_passed_on_as_slurm_set_it(tmp_path):
    """Two SLURM jobs on one node, each numbered from 0 (as with ConstrainDevices): both run,
    since each job leases in a directory of its own."""
    a = launch(
        2, [*SHOW_AND_HOLD, "2"], {"SLURM_JOB_ID": "11", "CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path
    )
    time.sleep(0.5)
    b = launch(
        2, [*SHOW_AND_HOLD, "0"], {"SLURM_JOB_ID": "12", "CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path
    )
    assert visible(b) == ["0", "1"] and visible(a) == ["0", "1"]
    assert (tmp_path / "slurm-job-11").is_dir() and (tmp_path / "slurm-job-12").is_dir()


def test_slurm_job_without_gpus_fails_clearly(tmp_path):
    proc = launch(2, ["true"], {"SLURM_JOB_ID": "13"}, tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "SLURM job 13 (CUDA_VISIBLE_DEVICES is unset)" in err


@pytest.mark.parametrize("argv", [[], ["4"], ["x", "--", "true"], ["4", "true"]])
def test_usage(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "workflow_scripts.lib.workflow.gpus", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "usage:" in proc.stderr


# ----------------------------------------------------------------- through Snakemake

STUB_EXTRACT = '''\
"""Stands in for the extraction script: records the GPUs it was given and when it ran."""
import json, os, sys, time
argv = sys.argv[1:]
start = time.time()
time.sleep(3)
record = {
    "job_index": argv[argv.index("--job-index") + 1],
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "start": start,
    "end": time.time(),
}
with open(argv[argv.index("--part") + 1], "w") as fh:
    json.dump(record, fh)
'''


@pytest.mark.workflow
def test_snakemake_local_run_gives_concurrent_extraction_jobs_their_own_gpus(tmp_path):
    """The real extract rule under Snakemake's local executor, 2 jobs x 4 GPUs on a machine with
    8 (a fake nvidia-smi; the environment taken for the GPU build): both run at once, on GPUs 0-3
    and 4-7. The extraction script itself is replaced in the workflow's copy by a stub that
    records what it was given."""
    config = {"extract": {"use_gpus": True, "tensor_parallel_size": 4, "num_jobs": 2}}
    wd = workflow_runner.as_gpu_environment(workflow_runner.copy_workflow(tmp_path / "wf", config))
    (wd / "workflow_scripts" / "stages" / "extract.py").write_text(STUB_EXTRACT)
    # the outputs of the stages before extraction, so that only extraction runs
    for rel in (
        "results/demo/chat_data.jsonl",
        "results/demo/eval_prompts.jsonl",
        "results/demo/verifier/config.json",
        "results/demo/verifier/model.safetensors",
        "results/demo/verifier/tokenizer.json",
        str(Layout("results").prepare.tokenized),
        str(Layout("results").prepare.stats),
    ):
        (wd / rel).parent.mkdir(parents=True, exist_ok=True)
        (wd / rel).write_text("{}\n")
    parts = [f"results/extract/parts/part_{i}.json" for i in range(2)]
    env = workflow_runner.env()  # `python` is this interpreter
    fake_nvidia_smi(tmp_path, 8)
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    env["EAGLE3_GPU_LOCK_DIR"] = str(tmp_path / "locks")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "snakemake"),
            *parts,
            "--cores",
            "8",
            "--resources",
            "gpu=8",
            "--configfile",
            "test_config.yaml",
        ],
        cwd=wd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    assert "rule demo" not in proc.stderr and "rule prepare" not in proc.stderr
    a, b = (json.loads((wd / p).read_text()) for p in parts)
    assert a["start"] < b["end"] and b["start"] < a["end"], "the two jobs did not run at once"
    ga, gb = a["visible"].split(","), b["visible"].split(",")
    assert len(ga) == len(gb) == 4 and not set(ga) & set(gb), (ga, gb)
    for i in range(2):
        log = (wd / f"results/logs/extract/job_{i}.log").read_text()
        assert "(4 GPU(s) leased)" in log


@pytest.mark.parametrize(
    "change, limit, expected",
    [
        (
            {"train": {"num_gpus": 16}},
            8,
            r"train\.num_gpus is 16 GPUs, but snakemake --resources gpu=8",
        ),
        (
            {"extract": {"tensor_parallel_size": 4, "pipeline_parallel_size": 4}},
            8,
            r"extract\.tensor_parallel_size x extract\.pipeline_parallel_size is 16 GPUs, .*; lower "
            r"extract\.tensor_parallel_size",
        ),
        (
            {"gpus_per_node": 4, "evaluate": {"tensor_parallel_size": 8}},
            None,
            r"evaluate\.tensor_parallel_size is 8 GPUs, but a node has 4 \(gpus_per_node\)",
        ),
        (
            {"regenerate": {"enabled": True, "tensor_parallel_size": 8}},
            4,
            r"regenerate\.tensor_parallel_size is 8 GPUs",
        ),
    ],
    ids=["train", "extract_pipeline", "per_node", "regenerate"],
)
def test_a_gpu_job_asking_more_gpus_than_there_are_is_refused(change, limit, expected):
    """At dry-run (rules/common.smk): Snakemake would cap the job at --resources gpu=N quietly,
    and the job would fail when it starts, after every stage before it."""
    import yaml

    from workflow_scripts.lib.common import UserError
    from workflow_scripts.lib.workflow.checks import check_gpu_counts
    from workflow_scripts.lib.workflow.config import load_config

    base = yaml.safe_load((ROOT / "config.gpu-8x.yaml").read_text())
    config = {**base, **{k: {**base.get(k, {}), **v} if isinstance(v, dict) else v
                         for k, v in change.items()}}  # fmt: skip
    check_gpu_counts(load_config(base), 8)  # the 8-GPU config as shipped fits an 8-GPU node
    with pytest.raises(UserError, match=expected):
        check_gpu_counts(load_config(config), limit)
