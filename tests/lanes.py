"""Two lanes: the tests that need no session build run in a second pytest process, beside this one.

A session's builds (conftest.py Builds) take one core while they are made, and most of the
tests after them run one process at a time on one core (a CPU engine computes on all cores but
one, Snakemake plans on one, a SLURM job is waited for): on two cores one core was idle for
about half of a full session. So, when a session holds tests of both kinds, those that need no
build (conftest.py ranks their modules 0) go to a second pytest process, started as soon as the
tests are collected, while this one runs the others beside it and the builds. At the end this
one waits for it, prints its summary, and fails when it failed (the unit tier splits too: its
modules that need a build hold unit tests). A session of one kind (one module, the GPU tier)
runs in one process as before, and so does the second process itself, at the lowest priority:
the builds and this process are the session's longest path. Its output: ``lane.log`` beside its
base temporary directory (the path is printed).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

LANE_ENV = "EAGLE3_TEST_LANE"  # set in the second process: it splits nothing itself
RANK = pytest.StashKey[int]()  # conftest.py: the rank of an item's module (0: needs no build)
LANE = pytest.StashKey["Lane"]()
SUMMARY_LINES = 60
FAILURE_LINES = 600
HEADINGS = re.compile(r"^=+ (FAILURES|ERRORS|short test summary info) =+$")


def lowest_priority() -> None:
    """In the second process, before it starts (in a session of its own): the lowest CPU
    priority, so that it takes what the builds and this process leave idle and they stay as fast
    as alone (measured: at equal priority the builds took 15 minutes instead of 10.5 and this
    process ended no sooner). Where the kernel groups each session's processes (autogroup),
    the group's niceness is what counts."""
    os.nice(19)
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:  # no autogroup here: the process's own niceness counts
        pass


class Lane:
    """The second pytest process, running ``nodeids``."""

    def __init__(self, config: pytest.Config, nodeids: list[str]):
        given = config.option.basetemp
        base = Path(f"{given}-lane") if given else Path(tempfile.mkdtemp(prefix="pytest-lane-"))
        base.mkdir(parents=True, exist_ok=True)
        self.log = base.with_name(base.name + ".log") if given else base / "lane.log"
        args = base.with_name(base.name + ".args") if given else base / "lane.args"
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
    lane = [item for item in items if item.stash.get(RANK, 0) == 0]
    rest = [item for item in items if item.stash.get(RANK, 0) > 0]
    if not lane or not rest:
        return
    config.stash[LANE] = Lane(config, [item.nodeid for item in lane])
    items[:] = rest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    lane = session.config.stash.get(LANE, None)
    if lane is None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        lane.stop()
    if lane.wait() != 0 and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lane = config.stash.get(LANE, None)
    if lane is None:
        return
    terminalreporter.section(
        f"the {lane.count} tests that need no session build, run beside these "
        f"(exit status {lane.proc.returncode}; all of it: {lane.log})"
    )
    terminalreporter.write_line(lane.summary())
