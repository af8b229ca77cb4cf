"""A stage entry run as a job runs it (``python -m workflow_scripts.stages.<stage> ARGS``, in a
process of its own, its exit code, stdout and stderr returned), but forked from a server
process that imported vLLM and transformers once for the test session: a fresh interpreter
spends about 10 s importing them, more than many of these runs take.

The server imports modules only (no engine, thread pool or device is started), so each run
starts as a fresh process would, except that OpenMP reads its environment when torch loads:
OMP_* variables given in ``env`` do not reach it (the stages set their threads themselves).
Tests that kill a job, or that watch its output while it runs, start a real interpreter; so do
scripts run by path (a test's serving script: vLLM's engine process, started from such a script
forked here, did not come up within 10 minutes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ["vllm", "transformers", "workflow_scripts.lib.hidden_states.extract_engines"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _main(module: str, args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_stage(
    module: str, args: list[str], cwd: Path, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``module`` run with ``args`` in ``cwd`` under ``env`` (default: this process's
    environment), to its end, returned as ``subprocess.run`` returns it."""
    cmd = [sys.executable, "-m", module, *args]
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = _context().Process(
            target=_main, args=(module, list(args), str(cwd), env, str(out), str(err))
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(cmd, proc.exitcode, out.read_text(), err.read_text())
