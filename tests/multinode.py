"""Training over several nodes, in the tests: the mechanics build's inputs (manifest, vocab map,
verifier) trained by the train stage itself, as one node of several processes, or as several
torchrun node ranks on this machine meeting at 127.0.0.1 (torchrun's static rendezvous, as the
stage starts it on each node of a SLURM job). Every process runs one thread (OMP_NUM_THREADS and
the like: the order of a sum depends on them), so that the layouts compared share the same
arithmetic."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from workflow_scripts.lib.workflow.config import layered
from workflow_scripts.lib.workflow.layout import METRICS, Layout

ROOT = Path(__file__).resolve().parents[1]

# Over the mechanics build's training: enough steps (50, two micro-batches each) for a
# checkpoint (step 20) well before the end, where a run is killed
TRAIN = {
    "epochs": 2,
    "micro_batch_budget_tokens": 512,
    "checkpoint_every_steps": 20,
    "validate_every_steps": 40,
}


def config_with(work: Path, **train) -> dict:
    """The workdir's test config with TRAIN and ``train`` over its train section."""
    config = yaml.safe_load((work / "test_config.yaml").read_text()) or {}
    return layered(config, {"train": {**TRAIN, **train}})


def train_params(work: Path, **train):
    from workflow_scripts.lib.workflow.config import load_config

    base = yaml.safe_load((work / "config.yaml").read_text())
    return load_config(layered(base, config_with(work, **train))).train


def stage_args(work: Path, params, out: Path) -> list[str]:
    from workflow_scripts.lib.workflow import cli

    results = work / "results"
    files = dict(
        manifest=Layout(results).extract.manifest,
        engine_cmd="",
        vocab_map=Layout(results).vocab.vocab_map,
        verifier=results / "demo" / "verifier",
        state_dir=out / "state",
        draft=out / "draft",
        metrics=out / METRICS,
    )
    return shlex.split(cli.render("train", params, files))


def env() -> dict[str, str]:
    from workflow_scripts.lib.training.processes import THREAD_VARIABLES

    return {**os.environ, "PYTHONPATH": str(ROOT), **{name: "1" for name in THREAD_VARIABLES}}


def train_one_node(work: Path, out: Path, processes: int) -> subprocess.CompletedProcess:
    """One node of ``processes`` processes (the stage starts its own torchrun)."""
    params = train_params(work, num_nodes=1, num_cpu_processes=processes)
    cmd = [sys.executable, "-m", "workflow_scripts.stages.train", *stage_args(work, params, out)]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_localhost_nodes(work: Path, out: Path, nodes: int) -> list[subprocess.Popen]:
    """``nodes`` torchrun node ranks of one process each on this machine, started as a user
    without SLURM starts them on each node; their logs in ``out``/node<rank>.log."""
    params = train_params(work, num_nodes=nodes, num_cpu_processes=1)
    args, port = stage_args(work, params, out), free_port()
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
            f"--node-rank={rank}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
            f"--master-port={port}", "-m", "workflow_scripts.stages.train", *args,
        ]  # fmt: skip
        log = open(out / f"node{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=log, stderr=log))
    return procs
