"""Start a job's command once on each of its nodes (SLURM), then wait.

    python -m workflow_scripts.lib.workflow.nodes N -- COMMAND [ARGS...]

The train rule renders its command through this launcher when ``train.num_nodes`` > 1
(``stage_cmd(..., nodes=N)`` in rules/common.smk), and reserves the nodes through its
``resources`` (``nodes``, ``tasks``, ``mpi``: the SLURM executor then submits one job over N
whole nodes and runs the command on the first, without an ``srun`` of its own). This launcher:

* ``N = 1``: runs COMMAND unchanged.
* Otherwise, inside a SLURM job of at least N nodes, runs
  ``srun --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=1 COMMAND``: one task per
  node, each of which starts that node's torchrun (``lib/training/processes.py``). When a node's
  processes fail or are killed, srun stops the others and the job fails, naming the node.
* Outside a SLURM job, or in one of fewer nodes, it stops before anything starts, saying how
  to run it (``snakemake --profile profiles/slurm``, or ``salloc --nodes=N`` first).

It logs one line naming the job and its nodes, so the rule's log says where training ran.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

USAGE = "usage: python -m workflow_scripts.lib.workflow.nodes N -- COMMAND [ARGS...]"


def log(msg: str) -> None:
    print(f"nodes: {msg}", file=sys.stderr, flush=True)


def srun_command(n: int, command: list[str]) -> list[str]:
    return [
        "srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        *command,
    ]  # fmt: skip


def scontrol(*args: str) -> str:
    """What ``scontrol ARGS`` prints ('' where it fails)."""
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def scontrol_fields(*args: str) -> dict[str, str]:
    """A one-line record (``scontrol show ... -o``) as its key=value fields."""
    return dict(f.split("=", 1) for f in scontrol(*args).split() if "=" in f)


def job_nodes(job_id: str) -> tuple[int, str]:
    """The SLURM job's node count and node list, as SLURM records them (the executor's job
    step keeps SLURM_JOB_ID but drops the allocation's other SLURM_* variables)."""
    fields = scontrol_fields("show", "job", "-o", job_id)
    return int(fields.get("NumNodes", "0").split("-")[0] or 0), fields.get("NodeList", "?")


def refusal(n: int, environ: dict[str, str]) -> str | None:
    """Why ``n`` nodes cannot be given to the command here, or None."""
    if "SLURM_JOB_ID" not in environ:
        return (
            f"train.num_nodes is {n}: training over several nodes runs inside a SLURM job of "
            f"{n} nodes. Run the workflow with the SLURM profile (snakemake --profile "
            f"profiles/slurm draft_ckpt), or inside an allocation (salloc --nodes={n} ...), or "
            "set train.num_nodes: 1"
        )
    have, nodelist = job_nodes(environ["SLURM_JOB_ID"])
    if have < n:
        return (
            f"train.num_nodes is {n}, but SLURM job {environ['SLURM_JOB_ID']} has {have} "
            f"node(s) ({nodelist}): the profile or the allocation gives the train job fewer "
            "nodes than the config asks (a set-resources 'nodes' for rule train replaces the "
            "rule's own)"
        )
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit() or int(argv[0]) < 1:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    n, command = int(argv[0]), argv[2:]
    if n == 1:
        os.execvp(command[0], command)
    reason = refusal(n, dict(os.environ))
    if reason:
        log(f"error: {reason}")
        sys.exit(2)
    cmd = srun_command(n, command)
    job = os.environ["SLURM_JOB_ID"]
    log(
        f"SLURM job {job}: {n} nodes ({job_nodes(job)[1]}), one task each: {shlex.join(cmd[:6])} ..."
    )
    rc = subprocess.call(cmd)
    if rc != 0:
        log(
            f"error: the command stopped on at least one of the {n} nodes (srun exit status "
            f"{rc}; srun's own lines above name the node and task). When a node's processes "
            "fail or are killed, srun stops the others. Run the same command again (on a new "
            "allocation): training resumes from its last checkpoint"
        )
        sys.exit(rc)


if __name__ == "__main__":
    main()
