"""extract.disk_budget: the plan (what is kept, the peak, the least budget, the costs), the engine
and training sharing a directory within the budget without waiting on each other forever, and,
on the mechanics build with real vLLM, the same draft as the unbounded run after a kill of the
engine (a killed trainer takes its engine with it: tested with a stand-in engine); the dry-run's
refusal."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests import factories
from tests.workflow_runner import dry_run_in_process
from workflow_scripts.lib.common import UserError, sha256_file
from workflow_scripts.lib.hidden_states.manifest import merge_parts
from workflow_scripts.lib.hidden_states.records import ExtractPart, StreamPlan
from workflow_scripts.lib.hidden_states.stream_producer import used_bytes
from workflow_scripts.lib.training import disk_budget
from workflow_scripts.lib.training.loader import Plan
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.config import load_config
from workflow_scripts.lib.workflow.definitions import ExtractParams, TrainParams
from workflow_scripts.lib.workflow.layout import MANIFEST, METRICS, STREAM_PLAN, Layout

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


# --------------------------------------------------------------------------- the plan


def fake_stream_plan(num_shards: int, per_shard: int, seed: int = 0) -> StreamPlan:
    """A stream plan as extract_plan writes it, for shards of ``per_shard`` samples."""
    rng = np.random.default_rng(seed)
    shards, line = [], 0
    for i in range(num_shards):
        lengths = rng.integers(20, 120, per_shard).tolist()
        shards.append(
            {
                "index": i,
                "file": f"shard_{i:06d}.safetensors",
                "samples": list(range(line, line + per_shard)),
                "lengths": lengths,
                "final_rows": [n // 2 for n in lengths],
                "num_tokens": sum(lengths),
                "bytes": 1000 * sum(lengths),
                "fingerprint": f"f{i}",
            }
        )
        line += per_shard
    header = {"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 100}
    key = {"verifier": "v", "dtype": "float32", "code": "c"}
    return factories.stream_plan(shards, key, **header, shard_size_samples=per_shard)


def simulate(bp: disk_budget.BudgetPlan, total: int) -> int:
    """The engine and training as they run (the engine computes in order, each once its previous
    copy is gone and it fits; training waits for what a step reads and removes a recomputed shard
    after its occurrence's last step): the peak bytes; fails on a wait that never ends."""
    sizes = bp.sizes
    on_disk: dict[str, int] = {f"h{k}": s for k, s in enumerate(bp.heldout_sizes)}
    queue = [o for o in bp.computed()]
    ends: dict[int, list[int]] = {}
    for o in queue:
        if o.shard not in bp.kept:
            ends.setdefault(o.last, []).append(o.shard)
    peak = sum(on_disk.values())
    for step in range(total):
        needed = {o.shard for o in bp.occ if o.first <= step <= o.last}
        while (
            queue
            and (f"s{queue[0].shard}" not in on_disk)
            and (sum(on_disk.values()) + sizes[queue[0].shard] <= bp.budget)
        ):
            shard = queue.pop(0).shard
            on_disk[f"s{shard}"] = int(sizes[shard])
            peak = max(peak, sum(on_disk.values()))
        missing = [s for s in needed if f"s{s}" not in on_disk]
        assert not missing, f"step {step}: training waits for {missing}, the engine for room"
        for s in ends.pop(step, []):
            del on_disk[f"s{s}"]
    return peak


@pytest.mark.parametrize("window", [1, 2])
def test_a_budget_is_never_exceeded_and_never_waits_forever(window):
    stream_plan = fake_stream_plan(12, 16)
    p = TrainParams(epochs=3, micro_batch_budget_tokens=256, shuffle_window_shards=window, seed=3)
    whole = sum(s.bytes for s in stream_plan.shards)
    least = None
    for budget in (0, None, whole // 4, whole // 2, whole * 2):
        budget = least if budget is None else budget
        bp, plan, _, _ = disk_budget.budget_plan(stream_plan, p, budget, 1, Path("/tmp"))
        least = bp.minimum
        if budget < bp.minimum:
            with pytest.raises(UserError, match="extract.disk_budget.*below what training needs"):
                disk_budget.refuse_below_least(bp, str(budget), p)
            continue
        assert bp.peak <= budget
        assert simulate(bp, plan.total_steps) <= budget
        costs = bp.costs(p.epochs)
        if budget >= whole + bp.heldout_bytes:  # all kept: each state computed once
            assert costs["recomputed_shards"] == 0
            heldout_tokens = sum(s.num_tokens for s in bp.heldout)
            assert costs["extra_verifier_tokens"] == heldout_tokens
        if budget == least:  # nothing fits besides: every shard computed each epoch
            assert costs["kept_shards"] < costs["shards"]
            assert costs["verifier_tokens"] > costs["unbounded_verifier_tokens"]


def test_without_a_window_every_step_reads_every_shard_and_the_refusal_says_so():
    stream_plan = fake_stream_plan(6, 16)
    p = TrainParams(epochs=2, micro_batch_budget_tokens=256)
    whole = sum(s.bytes for s in stream_plan.shards)
    bp, _, _, _ = disk_budget.budget_plan(stream_plan, p, whole // 3, 1, Path("/tmp"))
    assert bp.minimum >= 0.9 * whole  # every shard is live through the whole epoch
    with pytest.raises(UserError, match="set it"):
        disk_budget.refuse_below_least(bp, "1KB", p)


def test_window_order_reads_a_shard_within_one_window_per_epoch():
    rng = np.random.default_rng(0)
    shard_of = np.repeat(np.arange(10), 20)
    lengths = rng.integers(10, 60, len(shard_of))
    plan = Plan(np.arange(len(shard_of)), lengths, 200, 0, 2, 1, shard_of=shard_of, window=2)
    for epoch in range(2):
        seen: list[set[int]] = []
        for i in range(plan.steps_per_epoch[epoch]):
            step = sum(plan.steps_per_epoch[:epoch]) + i
            seen.append(set(shard_of[np.concatenate(plan.global_batch(step))].tolist()))
        # a window's two shards, then the next window's: a step spans two windows at most
        assert all(len(s) <= 4 for s in seen)
        firsts = {}
        for i, s in enumerate(seen):
            for shard in s:
                firsts.setdefault(shard, i)
        lasts = {shard: max(i for i, s in enumerate(seen) if shard in s) for shard in firsts}
        assert max(lasts[s] - firsts[s] for s in firsts) < 0.4 * len(seen)
    # the same settings, the same order; no window: the order of before
    again = Plan(np.arange(len(shard_of)), lengths, 200, 0, 2, 1, shard_of=shard_of, window=2)
    assert all(np.array_equal(a, b) for a, b in zip(plan.global_batch(5), again.global_batch(5)))
    plain = Plan(np.arange(len(shard_of)), lengths, 200, 0, 2, 1)
    assert plain.total_steps > 0 and plain.window is None


def test_budget_sizes_and_shares(tmp_path):
    assert disk_budget.budget_bytes("2TB", tmp_path) == 2 * 10**12
    assert disk_budget.budget_bytes("500GiB", tmp_path) == 500 * 2**30
    assert disk_budget.budget_bytes("1000", tmp_path) == 1000
    share = disk_budget.budget_bytes("10%", tmp_path)
    assert 0 < share < os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(ValueError):
        ExtractParams(disk_budget="lots")


# --------------------------------------------------------------------------- the real thing


def render(stage: str, params, files: dict) -> list[str]:
    return [
        PY,
        "-m",
        f"workflow_scripts.stages.{stage}",
        *shlex.split(cli.render(stage, params, files)),
    ]


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


class Build:
    """The mechanics build's verifier, tokenized data and vocab map, in shards of 16 samples."""

    def __init__(self, work: Path, out: Path):
        self.out = out
        self.tokenized = work / "results" / "prepare" / "tokenized_data.jsonl"
        self.verifier = work / "results" / "demo" / "verifier"
        self.vocab_map = Layout(work / "results").vocab.vocab_map
        cfg = load_config(yaml.safe_load((work / "config.yaml").read_text()))
        self.extract = cfg.extract.model_copy(update={"shard_size_samples": 16})
        self.train = cfg.train.model_copy(
            update=dict(
                epochs=2,
                shuffle_window_shards=1,
                micro_batch_budget_tokens=512,
                checkpoint_every_steps=4,
                validate_every_steps=8,
                warmup_steps=2,
            )
        )

    def engine_cmd(self, budget: str, stream: Path) -> str:
        p = self.extract.model_copy(update={"disk_budget": budget})
        files = dict(tokenized=self.tokenized, verifier=self.verifier, shard_dir=stream)
        return shlex.join(render("extract_stream", p, files))

    def train_cmd(self, manifest: Path, engine_cmd: str, out: Path) -> list[str]:
        files = dict(
            manifest=manifest,
            engine_cmd=engine_cmd,
            vocab_map=self.vocab_map,
            verifier=self.verifier,
            state_dir=out / "state",
            draft=out / "draft",
            metrics=out / METRICS,
        )
        return render("train", self.train, files)


@pytest.fixture(scope="module")
def unbounded(mechanics_build, tmp_path_factory):
    """Extraction of every shard, the stream plan, and the unbounded run's draft."""
    work, _ = mechanics_build
    b = Build(work, tmp_path_factory.mktemp("disk_budget"))
    shard_dir, part = b.out / "shards", b.out / "part_0.json"
    files = dict(
        tokenized=b.tokenized, verifier=b.verifier, shard_dir=shard_dir, job_index=0, part=part
    )
    proc = run(render("extract", b.extract, files))
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = b.out / MANIFEST
    merge_parts([(part, ExtractPart.read(part))], manifest).write(manifest)
    b.plan = b.out / STREAM_PLAN
    files = dict(tokenized=b.tokenized, verifier=b.verifier, shard_dir=b.out / "s", plan=b.plan)
    proc = run(render("extract_plan", b.extract, files))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run(b.train_cmd(manifest, "", b.out / "unbounded"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return b, sha256_file(b.out / "unbounded" / "draft" / "model.safetensors")


class PeakSampler(threading.Thread):
    def __init__(self, directory: Path):
        super().__init__(daemon=True)
        self.directory, self.peak, self.done = directory, 0, False

    def run(self):
        while not self.done:
            if self.directory.is_dir():
                self.peak = max(self.peak, used_bytes(self.directory))
            time.sleep(0.01)


def start(cmd: list[str], err: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(err, "w")
    )


def wait_for(predicate, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.engine
def test_within_a_budget_the_draft_is_the_unbounded_ones_after_kills(unbounded):
    b, expected = unbounded
    plan = StreamPlan.read(b.plan)
    sizes = sorted(s.bytes for s in plan.shards)
    stream, out = b.out / "stream", b.out / "streamed"
    bp, _, _, _ = disk_budget.budget_plan(plan, b.train, 10**15, 1, stream)
    budget = bp.minimum + sizes[-1]  # room for one shard more than the least: some kept
    cmd = b.train_cmd(b.plan, b.engine_cmd(str(budget), stream), out)
    sampler = PeakSampler(stream)
    sampler.start()

    # kill -9 the engine after training's first checkpoint: training stops naming its log,
    # nothing half-written is taken (that the engine dies with a killed trainer: below)
    proc = start(cmd, b.out / "engine_killed.log")
    log_text = lambda: (b.out / "engine_killed.log").read_text()  # noqa: E731
    state = out / "state" / "state.pt"
    wait_for(lambda: state.exists() and "engine started (pid" in log_text(), proc)
    pid = int(log_text().split("engine started (pid ", 1)[1].split(",", 1)[0])
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(300) != 0
    assert "the engine computing hidden states stopped" in log_text()
    assert str(out / "state" / "engine.log") in log_text()

    # the same command again: resumed, the same draft as the unbounded run's
    proc = run(cmd)
    sampler.done = True
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    assert sha256_file(out / "draft" / "model.safetensors") == expected
    assert 0 < sampler.peak <= budget
    costs = bp.costs(b.train.epochs)
    assert costs["recomputed_shards"] == 0  # an unlimited budget keeps every shard


def test_the_engine_dies_with_a_trainer_killed_outright(tmp_path):
    """kill -9 of the process that started the engine (training's first process) takes the
    engine with it (its parent-death signal): here an engine that would sleep for minutes."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from workflow_scripts.lib.training.stream_consumer import Engine\n"
        "e = Engine(['sleep', '300'], Path(sys.argv[1]), None)\n"
        "print(e.proc.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen(
        [PY, "-c", script, str(tmp_path / "engine.log")], cwd=ROOT, env=env, stdout=subprocess.PIPE
    )
    engine = int(trainer.stdout.readline())
    assert Path(f"/proc/{engine}").exists()
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(engine):
        time.sleep(0.05)
    assert not _running(engine), "the engine outlived its trainer"


def _running(pid: int) -> bool:
    """Alive, and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.workflow
def test_dry_run_shows_the_costs_and_refuses_a_budget_too_small(mechanics_build):
    work, config = mechanics_build
    plan = Layout(work / "results").extract.stream_plan

    def dry_run(target: str, disk_budget: str, **more) -> tuple[str | None, str]:
        train = {**config.get("train", {}), "shuffle_window_shards": 1}
        changed = {**config, "extract": {"disk_budget": disk_budget}, "train": train, **more}
        return dry_run_in_process(work, target, changed)

    try:
        # the plan is the extract_plan job's output; before it exists, the train job checks
        assert dry_run("draft_ckpt", "1KB")[0] is None
        cfg = load_config(yaml.safe_load((work / "config.yaml").read_text()))
        files = dict(
            tokenized=work / "results" / "prepare" / "tokenized_data.jsonl",
            verifier=work / "results" / "demo" / "verifier",
            shard_dir=work / "results" / "extract" / "stream",
            plan=plan,
        )
        proc = run(render("extract_plan", cfg.extract, files))
        assert proc.returncode == 0, proc.stderr[-3000:]
        error, out = dry_run("draft_ckpt", "1KB")
        assert error is not None and "extract.disk_budget '1KB'" in error
        assert "below what training needs" in error and "train.shuffle_window_shards" in error
        error, out = dry_run("vocab_map", "1KB")  # needs no training: a warning only
        assert error is None and "below what training needs" in out
        error, out = dry_run("draft_ckpt", "10GB")
        assert error is None and "hidden states: disk budget 9.313 GiB: peak" in out
        # the engine's GPUs beside training's, against a node's
        error, _ = dry_run(
            "draft_ckpt",
            "10GB",
            gpus_per_node=1,
            extract={"disk_budget": "10GB", "use_gpus": True},
            train={"num_gpus": 1, "shuffle_window_shards": 1},
        )
        assert "train.num_gpus + extract.tensor_parallel_size (extract.disk_budget) is 2" in error
    finally:
        plan.unlink(missing_ok=True)


def test_a_budget_the_disk_cannot_hold_is_refused_before_the_engine_starts(tmp_path):
    from types import SimpleNamespace

    from workflow_scripts.lib.training.processes import Dist
    from workflow_scripts.lib.training.stream_consumer import Stream, StreamedIndex

    stream_plan = fake_stream_plan(6, 16)
    for shard in stream_plan.shards:
        shard.bytes = 10**18  # an exabyte a shard: more than any disk here
    directory = tmp_path / "stream"
    engine = render("extract_stream", ExtractParams(disk_budget="100000000TB"), {
        "tokenized": tmp_path / "t.jsonl", "verifier": tmp_path / "v", "shard_dir": directory,
    })  # fmt: skip
    p = TrainParams(epochs=1, micro_batch_budget_tokens=256, shuffle_window_shards=1)
    index = StreamedIndex(stream_plan, directory, None, p.micro_batch_budget_tokens)
    plan, val_ids = disk_budget.training_plan(len(index), index.shard_of, index.lengths, p, 1)
    io = SimpleNamespace(engine_cmd=shlex.join(engine), state_dir=tmp_path / "state")
    stream = Stream(io, p, index, plan, val_ids, Dist())
    with pytest.raises(UserError, match="extract.disk_budget '100000000TB': the plan's peak is"):
        stream.start(0, teacher=None)
    assert stream.engine is None and not (directory / "schedule.json").exists()
