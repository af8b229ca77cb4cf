"""Lanes: the tests that need no session build run in other pytest processes, beside this one.

A session's builds (conftest.py Builds) take one core while they are made, and most of the
tests after them run one process at a time on one core (a CPU engine computes on all cores but
one, Snakemake plans on one, a SLURM job is waited for): on two cores one core was idle for
about half of a full session. So, when a session holds tests of both kinds, those that need no
build (conftest.py ranks their modules 0) go to LANES more pytest processes, started as soon as
the tests are collected, while this one runs the others beside them and the builds. At the end
this one waits for them, prints their summaries, and fails when one failed (the unit tier splits
too: its modules that need a build hold unit tests). A session of one kind (one module, the GPU
tier) runs in one process as before, and so does a lane itself, at the lowest priority: the
builds and this process are the session's longest path. Two lanes, not one: a lane alone uses
two thirds of a core on average (its tests start processes and wait on them), and the part of
the lanes' work left when this process ends ran on one core, the other idle. A lane holds whole
modules (their fixtures are set up once), shared out by their weight (split_by_module). Its
output: ``lane<N>.log`` beside its base temporary directory (the paths are printed).

A module with a test marked PINNED stays in this process (it runs while the builds are made): a
lane's CPU engine workers bound to cores (tensor parallelism) waited at the lowest priority
behind whatever ran on their cores, and tensor parallelism waits for its slowest worker (an
extraction of 26 s alone ran past its 300-second limit in a lane).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

LANE_ENV = "EAGLE3_TEST_LANE"  # set in a lane's process: it splits nothing itself
RANK = pytest.StashKey[int]()  # conftest.py: the rank of an item's module (0: needs no build)
LANES = 2  # processes for the tests that need no build (see above)
LANE = pytest.StashKey[list["Lane"]]()
PINNED = "pinned"
PINNED_MEANING = "starts CPU engine workers bound to cores: its module runs in no lane"
SLOW_WEIGHT = 40  # a slow test (an engine, Snakemake, processes) weighs about 40 unit tests
SUMMARY_LINES = 60
FAILURE_LINES = 600
HEADINGS = re.compile(r"^=+ (FAILURES|ERRORS|short test summary info) =+$")


def lowest_priority() -> None:
    """In a lane's process, before it starts (in a session of its own): the lowest CPU
    priority, so that it takes what the builds and this process leave idle and they stay as fast
    as alone (measured: at equal priority the builds took 15 minutes instead of 10.5 and this
    process ended no sooner). Where the kernel groups each session's processes (autogroup),
    the group's niceness is what counts."""
    os.nice(19)
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:  # no autogroup here: the process's own niceness counts
        pass


def module_of(item: pytest.Item) -> str:
    """The file of an item's module, as its node id names it (tests/test_x.py)."""
    return item.nodeid.split("::")[0]


def split_by_module(items: list[pytest.Item], lanes: int) -> list[list[pytest.Item]]:
    """``items`` in ``lanes`` parts of whole modules, the heaviest module first to the lightest
    part (a test weighs 1, a slow one SLOW_WEIGHT); each part keeps the items' order."""
    modules: Counter[str] = Counter()
    for item in items:
        modules[module_of(item)] += SLOW_WEIGHT if item.get_closest_marker("slow") else 1
    loads, part_of = [0] * lanes, {}
    for module in sorted(modules, key=lambda m: -modules[m]):
        part_of[module] = loads.index(min(loads))
        loads[part_of[module]] += modules[module]
    parts: list[list[pytest.Item]] = [[] for _ in range(lanes)]
    for item in items:
        parts[part_of[module_of(item)]].append(item)
    return [part for part in parts if part]


def for_lanes(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """``items`` parted, each part in their order: those for the lanes (their module needs no
    build and has no PINNED test) and those for this process."""
    pinned = {module_of(item) for item in items if item.get_closest_marker(PINNED)}

    def laned(item: pytest.Item) -> bool:
        return item.stash.get(RANK, 0) == 0 and module_of(item) not in pinned

    return [item for item in items if laned(item)], [item for item in items if not laned(item)]


class Lane:
    """A lane's pytest process, running ``nodeids``."""

    def __init__(self, config: pytest.Config, nodeids: list[str], index: int):
        given = config.option.basetemp
        name = f"lane{index}"
        base = (
            Path(f"{given}-{name}") if given else Path(tempfile.mkdtemp(prefix=f"pytest-{name}-"))
        )
        base.mkdir(parents=True, exist_ok=True)
        self.log = base.with_name(base.name + ".log") if given else base / f"{name}.log"
        args = base.with_name(base.name + ".args") if given else base / f"{name}.args"
        args.write_text("".join(f"{n}\n" for n in nodeids))
        cmd = [sys.executable, "-m", "pytest", f"@{args}", "-q", "-rfE", "-p", "no:cacheprovider"]
        cmd += ["--basetemp", str(base / "tmp")]
        if config.option.durations is not None:
            cmd.append(f"--durations={config.option.durations}")
        if config.option.maxfail:
            cmd.append(f"--maxfail={config.option.maxfail}")
        self.count = len(nodeids)
        with open(self.log, "w") as log:  # the process keeps its own copy of the file
            self.proc = subprocess.Popen(
                cmd,
                cwd=config.rootpath,
                env={**os.environ, LANE_ENV: "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # stop() ends its whole process group
                preexec_fn=lowest_priority,
            )

    def wait(self) -> int:
        return self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()

    def summary(self) -> str:
        """Its failures and errors with their tracebacks (up to FAILURE_LINES), then its short
        summary; or the end of its output."""
        lines = self.log.read_text(errors="replace").splitlines()
        marks = [i for i, line in enumerate(lines) if HEADINGS.search(line)]
        tail = lines[marks[0] :] if marks else lines[-SUMMARY_LINES:]
        if len(tail) > FAILURE_LINES:
            tail = [*tail[: FAILURE_LINES - SUMMARY_LINES], "[...]", *tail[-SUMMARY_LINES:]]
        return "\n".join(tail)


@pytest.hookimpl(trylast=True)  # after the -m and -k selections: the session's own items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(LANE_ENV) or config.option.collectonly:
        return
    lane, rest = for_lanes(items)
    if not lane or not rest:
        return
    parts = split_by_module(lane, LANES)
    config.stash[LANE] = [
        Lane(config, [item.nodeid for item in part], index) for index, part in enumerate(parts)
    ]
    items[:] = rest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    lanes = session.config.stash.get(LANE, [])
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        for lane in lanes:
            lane.stop()
    failed = [lane for lane in lanes if lane.wait() != 0]
    if failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for lane in config.stash.get(LANE, []):
        terminalreporter.section(
            f"{lane.count} of the tests that need no session build, run beside these "
            f"(exit status {lane.proc.returncode}; all of it: {lane.log})"
        )
        terminalreporter.write_line(lane.summary())
