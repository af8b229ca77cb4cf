"""The embedded default on one GPU (config.demo-gpu.yaml), as `make demo GPU=1` runs it: planned
here with every GPU job on the one GPU, and run end to end by the suite's GPU tier (`make test
GPU=1`, `pytest -m gpu`) on a machine with a GPU and vLLM's CUDA build."""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from tests.workflow_runner import as_gpu_environment, copy_workflow, jobs_in, snakemake
from workflow_scripts.lib.workflow.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
GPU_DEMO = yaml.safe_load((ROOT / "config.demo-gpu.yaml").read_text())
GPU_JOBS = {"extract", "train", "evaluate_reference", "evaluate_draft"}


def cuda_vllm() -> bool:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return torch.cuda.is_available()


@pytest.mark.workflow
def test_the_gpu_demo_plans_each_gpu_job_on_the_one_gpu(tmp_path):
    """What `make demo GPU=1` runs, planned in an environment taken for the GPU build: the
    extraction, training and evaluation jobs each reserve one GPU and run through the launcher
    that gives it to them; the rest of the embedded default's jobs reserve none."""
    work = as_gpu_environment(copy_workflow(tmp_path / "wf", GPU_DEMO))
    proc = snakemake(work, "-n", "-p", "evaluate", "--resources", "gpu=1")
    out = proc.stdout + proc.stderr
    assert set(jobs_in(out)) >= GPU_JOBS | {"demo", "prepare", "vocab", "extract_merge"}
    jobs = re.findall(r"^(?:local)?rule (\w+):\n(.*?)(?=^\S)", out, flags=re.M | re.S)
    reserving = {rule for rule, body in jobs if re.search(r"resources: .*\bgpu=1\b", body)}
    assert reserving == GPU_JOBS
    commands = re.findall(r"^Shell command: (.*)$", out, flags=re.M)
    for stage in ("extract", "train", "evaluate_reference", "evaluate"):
        command = next(c for c in commands if f" -m workflow_scripts.stages.{stage} " in c)
        assert " -m workflow_scripts.lib.workflow.gpus 1 -- " in command, command


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_vllm(), reason="needs an NVIDIA GPU and vLLM's CUDA build (.venv-gpu)")
def test_the_embedded_default_runs_on_one_gpu(tmp_path):
    """`make demo GPU=1 TARGET=evaluate` in a copy of the workflow: every stage runs, the GPU jobs
    on GPU 0, and the draft is accepted."""
    work = copy_workflow(tmp_path / "wf", GPU_DEMO)
    snakemake(work, "--cores", "all", "evaluate", "--resources", "gpu=1")
    results_dir = work / GPU_DEMO["results_dir"]
    results = json.loads((Layout(results_dir).evaluate.results).read_text())
    assert results["summary"]["eagle3_mean_acceptance_length"] > 1.0, results["summary"]
    for log in ("extract/job_0.log", "train.log", "evaluate_reference.log", "evaluate.log"):
        assert "CUDA_VISIBLE_DEVICES=0" in (results_dir / "logs" / log).read_text(), log
