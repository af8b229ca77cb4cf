"""Start a job's command over the nodes of its SLURM job, then wait.

    python -m workflow_scripts.lib.workflow.nodes N [--key KEY] [--engine DIR --gpus G] -- COMMAND...

The rules that span nodes render their command through this launcher when the config asks for
several (``stage_cmd(..., nodes=N)`` in rules/common.smk), and reserve the nodes through their
``resources`` (``nodes``, ``tasks``, ``mpi``: the SLURM executor then submits one job over N
whole nodes and runs the command on the first, without an ``srun`` of its own). ``KEY``: the
config key that asks for the nodes (``train.num_nodes``, ``extract.num_nodes``, ...), for
messages. This launcher:

* ``N = 1``: runs COMMAND unchanged.
* Training (no ``--engine``): inside a SLURM job of at least N nodes, runs
  ``srun --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=1 COMMAND``: one task per
  node, each of which starts that node's torchrun (``lib/training/processes.py``). When a node's
  processes fail or are killed, srun stops the others and the job fails, naming the node.
* An engine stage (``--engine DIR``: the verifier's vLLM engine spans the nodes,
  ``lib/verifier/engine_nodes.py``): runs COMMAND (the stage) here, on the first node, and on
  each other node, with srun, the engine's follower with G GPUs of that node, which starts the
  node's workers with the arguments the stage's engine publishes in DIR. When the stage ends,
  the followers are stopped; when a follower ends first (its node lost, a worker dead), the
  stage is stopped and the job fails, naming the node. Only the first node writes results.
* Outside a SLURM job, or in one of fewer nodes, it stops before anything starts, saying how
  to run it (``snakemake --profile profiles/slurm``, or ``salloc --nodes=N`` first).

It logs one line naming the job and its nodes, so the rule's log says where the job ran.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from workflow_scripts.lib import common

USAGE = (
    "usage: python -m workflow_scripts.lib.workflow.nodes N [--key KEY] [--engine DIR --gpus G] "
    "-- COMMAND [ARGS...]"
)
STOP_WAIT_S = 30  # how long a stopped process may take to exit before it is killed


def launch(python: str, n: int, command: str, key: str, meet_dir=None, gpus: int = 0) -> str:
    """``command`` (a shell command line) run through this launcher over ``n`` nodes, as the
    rules render it; ``meet_dir``: an engine stage's (see the module's docstring)."""
    args = [str(n), "--key", key]
    if meet_dir is not None:
        args += ["--engine", str(meet_dir), "--gpus", str(int(gpus))]
    return f"{python} -m workflow_scripts.lib.workflow.nodes {shlex.join(args)} -- {command}"


def node_resources(nodes: int, gpus_per_node: int) -> dict:
    """A GPU rule's resources besides ``gpu`` (the job's total): one node, or ``nodes`` whole
    nodes for one SLURM job with ``gpus_per_node`` GPUs on each (gres is per node), the command
    run once on the first node (mpi: the executor adds no srun of its own) and started on the
    others by the nodes launcher (``launch``: srun, one task per node)."""
    if nodes == 1:
        return dict(nodes=1)
    gres = dict(gres=f"gpu:{gpus_per_node}") if gpus_per_node else {}
    return dict(nodes=nodes, tasks=nodes, mpi="srun") | gres


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


def refusal(n: int, environ: dict[str, str], key: str = "train.num_nodes") -> str | None:
    """Why ``n`` nodes cannot be given to the command here, or None."""
    stage = key.split(".")[0]
    if "SLURM_JOB_ID" not in environ:
        return (
            f"{key} is {n}: the {stage} job over several nodes runs inside a SLURM job of "
            f"{n} nodes. Run the workflow with the SLURM profile (snakemake --profile "
            f"profiles/slurm ...), or inside an allocation (salloc --nodes={n} ...), or "
            f"set {key}: 1"
        )
    have, nodelist = job_nodes(environ["SLURM_JOB_ID"])
    if have < n:
        return (
            f"{key} is {n}, but SLURM job {environ['SLURM_JOB_ID']} has {have} "
            f"node(s) ({nodelist}): the profile or the allocation gives the job fewer "
            "nodes than the config asks (a set-resources 'nodes' for its rule replaces the "
            "rule's own)"
        )
    return None


def job_hosts(job_id: str) -> list[str]:
    """The SLURM job's node names, in SLURM's order (the first runs the batch step)."""
    return scontrol("show", "hostnames", job_nodes(job_id)[1]).split()


def node_address(host: str) -> str:
    """The address SLURM reaches ``host`` at (its NodeAddr)."""
    return scontrol_fields("show", "node", "-o", host).get("NodeAddr") or host


def follower_command(n: int, gpus: int) -> list[str]:
    """srun of the engine's follower on the job's nodes but the first, G GPUs each."""
    follower = [sys.executable, "-m", "workflow_scripts.lib.verifier.engine_follower"]
    if gpus:
        launcher = [sys.executable, "-m", "workflow_scripts.lib.workflow.gpus", str(gpus), "--"]
        follower = launcher + follower
    return [
        "srun", f"--nodes={n - 1}", f"--ntasks={n - 1}", "--ntasks-per-node=1", "--relative=1",
        "--kill-on-bad-exit=1", *follower,
    ]  # fmt: skip


def stop(proc: subprocess.Popen, group: bool) -> None:
    """SIGTERM (to its process group with ``group``), SIGKILL after STOP_WAIT_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            continue


def run_engine(n: int, key: str, meet_dir: Path, gpus: int, command: list[str]) -> int:
    """The stage here (node 0) and the engine's followers on the job's other nodes; returns the
    job's exit status."""
    job = os.environ["SLURM_JOB_ID"]
    hosts = job_hosts(job)[:n]
    meet = meet_dir.resolve() / f"job-{job}.json"
    meet.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update({
        common.ENGINE_NODES_ENV: str(n), common.ENGINE_HOSTS_ENV: ",".join(hosts),
        common.ENGINE_MASTER_ADDR_ENV: node_address(hosts[0]), common.ENGINE_ARGS_ENV: str(meet),
    })  # fmt: skip
    followers_cmd = follower_command(n, gpus)
    log(
        f"SLURM job {job}: {n} nodes ({', '.join(hosts)}), the verifier's engine over all of "
        f"them ({key}): the stage on {hosts[0]}, its followers started by "
        f"{shlex.join(followers_cmd[:7])} ..."
    )
    followers = subprocess.Popen(followers_cmd, env=env)
    stage = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        while stage.poll() is None:
            if followers.poll() is not None:
                log(
                    f"error: the engine's workers on {', '.join(hosts[1:])} stopped while the "
                    f"stage ran (srun exit status {followers.returncode}; srun's lines above "
                    "name the node and task): a node lost, or a worker dead (its log lines "
                    "above). The stage is stopped. Run the same command again (on a new "
                    "allocation): the stage goes on from what it had finished"
                )
                stop(stage, group=True)
                return 1
            time.sleep(1)
    finally:
        stop(followers, group=False)
        stop(stage, group=True)
        meet.unlink(missing_ok=True)
    if stage.returncode != 0:
        log(f"error: the stage failed on {hosts[0]} (exit status {stage.returncode})")
    return stage.returncode


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="nodes", usage=USAGE)
    ap.add_argument("n", type=int)
    ap.add_argument("--key", default="train.num_nodes")
    ap.add_argument("--engine", type=Path, help="the engine stage's meeting directory")
    ap.add_argument("--gpus", type=int, default=0, help="an engine's GPUs on each node")
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.n < 1 or not command:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    return args, command


def main(argv: list[str] | None = None) -> None:
    args, command = parse(sys.argv[1:] if argv is None else argv)
    n = args.n
    if n == 1:
        os.execvp(command[0], command)
    reason = refusal(n, dict(os.environ), args.key)
    if reason:
        log(f"error: {reason}")
        sys.exit(2)
    if args.engine is not None:
        sys.exit(run_engine(n, args.key, args.engine, args.gpus, command))
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
