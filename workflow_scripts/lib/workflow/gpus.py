"""Give a GPU job exactly the GPUs it reserved, then run its command.

    python -m workflow_scripts.lib.workflow.gpus N -- COMMAND [ARGS...]

Rules that reserve GPUs (``resources: gpu=N``) render their command through this launcher
(``stage_cmd(..., gpus=N)`` in rules/common.smk). Snakemake's local executor counts ``gpu``
against ``--resources gpu=...`` but never tells a job *which* GPUs are its own, so two concurrent
4-GPU jobs on an 8-GPU machine would both use GPUs 0-3. This launcher:

* ``N = 0``: runs COMMAND unchanged.
* Otherwise it leases N GPU ids from a pool and runs COMMAND with ``CUDA_VISIBLE_DEVICES`` set to
  them. The pool is ``CUDA_VISIBLE_DEVICES`` when that is set (inside a SLURM job: the GPUs that
  SLURM allocated; on a workstation: the GPUs the user allowed), else every GPU that
  ``nvidia-smi -L`` lists. Fewer than N GPUs in the pool is an error, raised before COMMAND runs.
* A lease is an exclusive ``flock`` on one lock file per GPU id in the lock directory
  (``$EAGLE3_GPU_LOCK_DIR``, default ``/tmp/eagle3-gpu-locks``; inside a SLURM job a
  subdirectory per job and node, since SLURM may number each job's GPUs from 0). The locks stay
  held by COMMAND (the file descriptors are inherited across ``exec``) and are released by the
  kernel when it exits, however it exits: nothing is left to clean up after a crash or a kill.
  When the pool has enough GPUs but fewer than N are free, the launcher waits for them.
* Inside a SLURM job whose allocation holds exactly N GPUs (the SLURM executor's jobs), the
  lease is the whole allocation: ``CUDA_VISIBLE_DEVICES`` is passed on as SLURM set it.

It logs one line (to stderr, i.e. the rule's log) naming the GPUs the job got, and under SLURM
the job id, so the log of every GPU job says which devices it ran on.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

LOCK_DIR_ENV = "EAGLE3_GPU_LOCK_DIR"
DEFAULT_LOCK_DIR = "/tmp/eagle3-gpu-locks"
WAIT_POLL_S = 2.0

USAGE = "usage: python -m workflow_scripts.lib.workflow.gpus N -- COMMAND [ARGS...]"


class GpuError(Exception):
    """Not enough GPUs for the job: reported in one line, exit status 2."""


def log(msg: str) -> None:
    print(f"gpus: {msg}", file=sys.stderr, flush=True)


def parse_visible(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as a list of ids (indices or GPU-/MIG- UUIDs); '' is no GPU."""
    return [v.strip() for v in value.split(",") if v.strip()]


def nvidia_smi_ids() -> tuple[list[str], str]:
    """Indices of the GPUs that ``nvidia-smi -L`` lists ('GPU 0: ...'), and where they came from."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "nvidia-smi -L (nvidia-smi is not installed)"
    try:
        out = subprocess.run(
            [exe, "-L"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        raise GpuError(f"nvidia-smi -L failed: {exc}") from None
    return re.findall(r"^GPU (\d+):", out, flags=re.M), "nvidia-smi -L"


def gpu_pool(environ: dict[str, str]) -> tuple[list[str], str]:
    """The GPU ids a job may lease from, and where that list came from."""
    job = environ.get("SLURM_JOB_ID")
    if "CUDA_VISIBLE_DEVICES" in environ:
        by = f"SLURM for job {job}" if job else "the caller"
        return parse_visible(environ["CUDA_VISIBLE_DEVICES"]), f"CUDA_VISIBLE_DEVICES (set by {by})"
    if job:
        # SLURM sets CUDA_VISIBLE_DEVICES for every job that it allocated GPUs
        return [], f"the allocation of SLURM job {job} (CUDA_VISIBLE_DEVICES is unset)"
    return nvidia_smi_ids()


def lock_dir(environ: dict[str, str]) -> Path:
    base = Path(environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
    if "SLURM_JOB_ID" in environ:  # a job's GPU ids are its own, node by node
        node = environ.get("SLURMD_NODENAME")
        return base / f"slurm-job-{environ['SLURM_JOB_ID']}{f'-{node}' if node else ''}"
    return base


def _make_shared_dir(path: Path) -> None:
    """Create the lock directory so that every user of the machine can lock in it (mode 1777,
    like /tmp); a directory that exists is used as it is."""
    for part in reversed([path, *path.parents]):
        if part.exists():
            continue
        try:
            part.mkdir()
            os.chmod(part, 0o1777)
        except FileExistsError:
            pass


def _lock_name(gpu_id: str) -> str:
    return "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", gpu_id) + ".lock"


def try_lease(pool: list[str], n: int, directory: Path) -> tuple[list[str], list[int]] | None:
    """Lock the first ``n`` free GPU ids of ``pool``: (ids, inheritable lock fds), or None when
    fewer than ``n`` are free (then nothing stays locked)."""
    _make_shared_dir(directory)
    ids: list[str] = []
    fds: list[int] = []
    for gpu_id in pool:
        # read-only is enough for flock, and lets a user lock a file another user created
        fd = os.open(directory / _lock_name(gpu_id), os.O_RDONLY | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        ids.append(gpu_id)
        fds.append(fd)
        if len(ids) == n:
            for f in fds:
                os.set_inheritable(f, True)  # held by COMMAND after exec
            return ids, fds
    for f in fds:
        os.close(f)
    return None


def lease(n: int, environ: dict[str, str], wait_poll_s: float = WAIT_POLL_S):
    """Lease ``n`` GPUs for this process: (ids, lock fds). Waits while they are taken."""
    pool, where = gpu_pool(environ)
    if len(pool) < n:
        found = f" ({','.join(pool)})" if pool else ""
        raise GpuError(
            f"this job needs {n} GPU(s), found {len(pool)}{found} in {where}. "
            "Lower the GPU settings in the config (extract.tensor_parallel_size, "
            "train.num_gpus), run on a machine with more GPUs, or on a cluster make the "
            "profile ask SLURM for them."
        )
    directory = lock_dir(environ)
    waited = False
    while True:
        got = try_lease(pool, n, directory)
        if got is not None:
            return got
        if not waited:
            log(
                f"waiting for {n} free GPU(s) of {','.join(pool)}: the others are leased by "
                f"other jobs (locks in {directory}); cap concurrent GPU jobs with "
                "snakemake --resources gpu=<number of GPUs>"
            )
            waited = True
        time.sleep(wait_poll_s)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--" or not re.fullmatch(r"\d+", argv[0]):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    n, command = int(argv[0]), argv[2:]
    environ = dict(os.environ)
    slurm = (
        f"SLURM job {environ['SLURM_JOB_ID']} on {environ.get('SLURMD_NODENAME', '?')}: "
        if "SLURM_JOB_ID" in environ
        else ""
    )
    if n == 0:
        if slurm:
            visible = environ.get("CUDA_VISIBLE_DEVICES")
            log(
                f"{slurm}CUDA_VISIBLE_DEVICES={visible if visible is not None else '(unset)'}; "
                "this command uses no GPU"
            )
        os.execvp(command[0], command)
    try:
        ids, _fds = lease(n, environ)
    except GpuError as exc:
        log(f"error: {exc}")
        sys.exit(2)
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    log(f"{slurm}CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} ({n} GPU(s) leased)")
    os.execvpe(command[0], command, environ)


if __name__ == "__main__":
    main()
