"""Hidden states within a disk budget (``extract.disk_budget``): training's side while it runs.
The plan (which shards are kept, the costs) is ``disk_budget.py``'s.

At the start of the job (and of a resumed one) training removes what a killed run left beyond
that order, writes the schedule (``hidden_states/stream.py``) and starts the engine as a process
of its own, on GPUs of its own (or training's, ``extract.share_training_gpus``). Training waits
for a shard's file before reading it, and removes a recomputed shard after the last step of its
occurrence. The engine computes occurrences in the order of their first step, each once it
fits; since training removes every shard once past it, what is on disk while training waits is
a part of what is live, and the engine always has room for what training waits for.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from workflow_scripts.lib.common import UserError, read_json
from workflow_scripts.lib.hidden_states import shards as shard_files
from workflow_scripts.lib.hidden_states import stream_producer as engine_side
from workflow_scripts.lib.hidden_states.records import ShardRecord, StreamPlan
from workflow_scripts.lib.training import teacher_check
from workflow_scripts.lib.training.loader import Plan
from workflow_scripts.lib.training.disk_budget import (
    BudgetPlan,
    Occurrence,
    SampleTable,
    budget_bytes,
    budget_plan,
    describe,
    gib,
    refuse_below_least,
)
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")
WAIT_LOG_S = 60.0
ENGINE_GPUS = "EAGLE3_ENGINE_GPUS"  # the engine's CUDA_VISIBLE_DEVICES, set by the train stage

# --------------------------------------------------------------------------- the engine process


def engine_command(engine_cmd: str) -> tuple[list[str], Any, Any]:
    """The engine's argv and its parsed (io, extract params): the rule renders the command from
    the extract settings; parsing it with the same definition gives training the budget."""
    argv = shlex.split(engine_cmd)
    at = argv.index("-m")
    io, p = cli.parse("extract_stream", argv[at + 2 :])
    return argv, io, p


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    os.setsid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Engine:
    """The engine's process: started by training's first process, stopped with it."""

    def __init__(self, argv: list[str], log_path: Path, gpus: str | None):
        self.log_path = log_path
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
        log.info("engine started (pid %d, log %s)", self.proc.pid, log_path)

    def check(self, waiting_for: str) -> None:
        code = self.proc.poll()
        if code is not None:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise UserError(
                f"the engine computing hidden states stopped (exit {code}) while training waited "
                f"for {waiting_for}; its log is {self.log_path}:\n  " + "\n  ".join(tail)
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


# --------------------------------------------------------------------------- reading


class StreamedIndex:
    """``data.SampleIndex`` for states that are computed while training runs: lengths from the
    stream plan, each shard opened once its file is there (waiting for it), and let go when
    training is past it."""

    def __init__(self, stream_plan: StreamPlan, directory: Path, aux_order, max_tokens: int):
        self.stream_plan, self.directory = stream_plan, directory
        self.aux_order, self.max_tokens = aux_order, max_tokens
        self.table = SampleTable(stream_plan)
        self.full_lengths = self.table.full_lengths
        self.lengths = np.minimum(self.full_lengths, max_tokens)
        self.shard_of, self.local_of = self.table.shard_of, self.table.local_of
        self.files = [directory / s.file for s in stream_plan.shards]
        self.fingerprints = [s.fingerprint for s in stream_plan.shards]
        self.heldout_at: dict[int, tuple[Path, str, int]] = {}  # g -> (file, fingerprint, place)
        self.readers: dict[Path, shard_files.ShardReader] = {}
        self.engine: Engine | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def set_heldout(self, val_ids: np.ndarray, heldout: list) -> None:
        at = 0
        for shard in heldout:
            for j in range(len(shard.samples)):
                self.heldout_at[int(val_ids[at])] = (shard.path, shard.fingerprint, j)
                at += 1

    def reader(self, path: Path, fingerprint: str) -> shard_files.ShardReader:
        reader = self.readers.get(path)
        if reader is not None:
            return reader
        waited, last_log = time.monotonic(), time.monotonic()
        while not path.exists():
            if self.engine is not None:
                self.engine.check(path.name)
            if time.monotonic() - last_log > WAIT_LOG_S:
                log.info(
                    "waiting for %s from the engine (%.0f s)", path.name, time.monotonic() - waited
                )
                last_log = time.monotonic()
            time.sleep(0.05)
        found = shard_files.shard_fingerprint(path)
        if found != fingerprint:
            raise UserError(
                f"{path} is not the shard the plan expects (fingerprint {str(found)[:12]}, "
                f"expected {fingerprint[:12]}): written for other data or settings; delete it "
                "and run again"
            )
        self.readers[path] = reader = shard_files.ShardReader(path)
        return reader

    def sample(self, g: int) -> shard_files.SampleStates:
        g = int(g)
        if g in self.heldout_at:
            path, fp, place = self.heldout_at[g]
        else:
            s = int(self.shard_of[g])
            path, fp, place = self.files[s], self.fingerprints[s], int(self.local_of[g])
        out = self.reader(path, fp).sample(place, int(self.lengths[g]))
        if self.aux_order is not None:
            out.aux_hidden_states = out.aux_hidden_states[:, self.aux_order]
        return out

    def release(self, shard: int) -> None:
        self.readers.pop(self.files[shard], None)


class Stream:
    """A run's stream: the plan from the resumed step, the directory made to fit it, the
    schedule written, the engine started (by the first process), shards removed after use."""

    def __init__(self, io, p, index: StreamedIndex, plan: Plan, val_ids, d):
        self.io, self.p, self.index, self.plan, self.val_ids, self.d = (
            io,
            p,
            index,
            plan,
            val_ids,
            d,
        )
        self.argv, self.engine_io, self.extract_p = engine_command(io.engine_cmd)
        self.directory = Path(self.engine_io.shard_dir)
        self.setting = self.extract_p.disk_budget
        self.engine: Engine | None = None
        self.ends: dict[int, list[int]] = {}  # step -> shards whose occurrence ends there

    def start(self, step: int, teacher) -> dict[str, Any]:
        """Plan from ``step``, tidy, write the schedule, start the engine (on the GPUs the train
        stage set aside for it), and check ``teacher`` on the first shard it writes."""
        d = self.d
        self.directory.mkdir(parents=True, exist_ok=True)
        budget = budget_bytes(self.setting, self.directory)
        bp, _, _, _ = budget_plan(
            self.index.stream_plan, self.p, budget, d.world, self.directory, start=step
        )
        refuse_below_least(bp, self.setting, self.p)
        room = shutil.disk_usage(self.directory).free + engine_side.used_bytes(self.directory)
        if bp.peak > room:
            raise UserError(
                f"extract.disk_budget {self.setting!r}: the plan's peak is {gib(bp.peak)} of hidden "
                f"states, but {self.directory} has {gib(room)} (free, and the states already "
                "there): lower extract.disk_budget, or free disk space"
            )
        costs = bp.costs(self.p.epochs)
        self.index.set_heldout(self.val_ids, bp.heldout)
        computed = bp.computed()
        self.first_computed = computed[0].shard if computed else 0
        for o in computed:
            if o.shard not in bp.kept:
                self.ends.setdefault(o.last + 1, []).append(o.shard)
        if d.main:
            log.info("%s", describe(costs))
            present = self._tidy(bp, computed)
            files = self.index.files
            engine_side.write_schedule(
                self.directory,
                {
                    "budget_bytes": budget,
                    "heldout": [s.samples for s in bp.heldout],
                    "order": [self.index.stream_plan.shards[o.shard].index for o in computed],
                    "present": present,
                    "fingerprints": {
                        **{s.path.name: s.fingerprint for s in bp.heldout},
                        **{f.name: fp for f, fp in zip(files, self.index.fingerprints)},
                    },
                },
            )
            gpus = os.environ.get(ENGINE_GPUS)
            self.engine = Engine(self.argv, Path(self.io.state_dir) / "engine.log", gpus)
            self.index.engine = self.engine
        d.barrier()
        if step < self.plan.total_steps:
            first = self.first_shard()
            plan = self.index.stream_plan
            teacher_check.verify_and_log(plan, teacher, d, self.io.verifier, [first])
        return costs

    def _tidy(self, bp: BudgetPlan, computed: list[Occurrence]) -> list[str]:
        """What a killed run left: kept and held-out shards stay; of the others, those in the
        order's prefix of shards on disk stay (the engine skips them), the rest go, so that the
        engine computes in order again. Partial files go. Returns the names that stay."""
        for path in self.directory.iterdir():
            if ".safetensors.tmp-" in path.name:
                path.unlink(missing_ok=True)
        keep: list[str] = []
        wanted = {s.path.name: s.fingerprint for s in bp.heldout}
        wanted.update({self.index.files[s].name: self.index.fingerprints[s] for s in bp.kept})
        prefix = True
        for o in computed:
            path = self.index.files[o.shard]
            if o.shard in bp.kept:
                continue
            ok = (
                path.exists()
                and shard_files.shard_fingerprint(path) == self.index.fingerprints[o.shard]
            )
            if prefix and ok and path.name not in keep:
                keep.append(path.name)
            else:
                prefix = False
        for name, fp in wanted.items():
            path = self.directory / name
            if path.exists() and shard_files.shard_fingerprint(path) == fp:
                keep.append(name)
        for path in engine_side.stream_files(self.directory):
            if path.name not in keep:
                path.unlink(missing_ok=True)
                path.with_name(path.name + ".sha256.json").unlink(missing_ok=True)
        return keep

    def after_step(self, step: int) -> None:
        """Step ``step`` (1-based: steps done) is over: let go of the shards no later step of
        their occurrence reads, and (first process) remove them."""
        for s in self.ends.pop(step, []):
            self.index.release(s)
            if self.d.main:
                path = self.index.files[s]
                path.unlink(missing_ok=True)
                path.with_name(path.name + ".sha256.json").unlink(missing_ok=True)

    def first_shard(self) -> ShardRecord:
        """The first shard the engine writes (a held-out one if any), once it and its record are
        there: what the teacher check reads."""
        heldout = sorted(self.index.heldout_at.values(), key=lambda v: v[0].name)
        if heldout:
            path, fp = heldout[0][0], heldout[0][1]
        else:
            first = self.first_computed
            path, fp = self.index.files[first], self.index.fingerprints[first]
        self.index.reader(path, fp)
        sidecar = path.with_name(path.name + ".sha256.json")
        while not sidecar.exists():
            if self.engine is not None:
                self.engine.check(sidecar.name)
            time.sleep(0.05)
        return ShardRecord(**read_json(sidecar)["entry"], path=str(path))

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
