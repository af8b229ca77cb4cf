"""Killing a job the hard way in tests: SIGKILL to its whole session once a condition holds,
and the shared memory that vLLM's processes leave behind released."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # state, ppid, pgrp, session
                pids.append(int(entry.name))
    return pids


def shared_memory_of_session(sid: int) -> set[str]:
    """/dev/shm files mapped by the processes of a session: a SIGKILL leaves them behind."""
    names = set()
    for pid in session_pids(sid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                names.add(parts[5].removesuffix(" (deleted)"))
    return names


def release_shared_memory(names: set[str]) -> None:
    for name in names:
        Path(name).unlink(missing_ok=True)


def kill_when(
    cmd: list[str], cwd: Path, ready: Callable[[], bool], timeout_s: float, what: str
) -> None:
    """Starts ``cmd`` in a session of its own and SIGKILLs the whole session as soon as
    ``ready()`` holds; fails if the command ends first or ``what`` takes over ``timeout_s``."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while not ready():
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            assert time.monotonic() < deadline, f"{what}: not in {timeout_s:.0f} s"
            time.sleep(0.02)
    finally:
        shared = shared_memory_of_session(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        release_shared_memory(shared)
