"""Training's processes: one, or several under torchrun with DDP (nccl on GPUs, gloo on the
CPU, whose cores are then shared out), on one node or several (``train.num_nodes``: one
torchrun per node, started by srun, meeting through torchrun's static rendezvous at the first
node of the SLURM job)."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.workflow.definitions import TrainParams
from workflow_scripts.lib.workflow.nodes import scontrol, scontrol_fields

log = logging.getLogger("eagle3")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    distributed: bool = False  # a process group (DDP): several processes, or under torchrun

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()


def setup_processes(p: TrainParams) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    wanted = p.processes_per_node * p.num_nodes
    if world != wanted:
        raise UserError(
            f"started as {world} process(es), the settings ask for {wanted} (train.num_nodes "
            f"{p.num_nodes} x {p.processes_per_node} per node)"
        )
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if p.num_gpus > 0:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # else torch already follows it
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # this node's processes
            torch.set_num_threads(threads_per_process(local))
    # a process group whenever torchrun started us, one process too (its NCCL path then runs)
    distributed = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ
    if distributed:
        dist.init_process_group("nccl" if p.num_gpus > 0 else "gloo")
    return Dist(rank, world, local_rank, device, distributed)


# What sets the threads of a process's linear algebra (OpenMP, MKL, OpenBLAS, ...): Snakemake sets
# every one to the job's threads, and the results depend on them (the order of a sum)
THREAD_VARIABLES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
)  # fmt: skip


def threads_per_process(world: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // world)


@dataclass
class Node:
    """This node's place among ``count`` nodes: torchrun's static rendezvous (node rank, and
    the address and port of node 0, where the rendezvous store runs)."""

    count: int
    rank: int
    master_addr: str
    master_port: int
    where: str  # for messages: the SLURM job and node

    def torchrun_args(self) -> list[str]:
        return [
            f"--nnodes={self.count}", f"--node-rank={self.rank}",
            f"--master-addr={self.master_addr}", f"--master-port={self.master_port}",
        ]  # fmt: skip


def slurm_node(count: int, environ: dict[str, str] | None = None) -> Node:
    """This node's place in the SLURM job step that srun started on each of ``count`` nodes
    (workflow_scripts/lib/workflow/nodes.py): the node rank is SLURM_NODEID; node 0 is the
    first host of the step, reached at the address SLURM itself uses (its NodeAddr); the port
    is derived from the job id, so that two jobs sharing a node do not meet."""
    env = dict(os.environ if environ is None else environ)
    if "SLURM_STEP_ID" not in env or "SLURM_NODEID" not in env:
        raise UserError(
            f"train.num_nodes is {count}: the train stage runs once on each node, started by "
            "srun (rule train renders it through workflow_scripts.lib.workflow.nodes); here "
            "it runs outside a SLURM job step. Run it through the workflow (snakemake --profile "
            "profiles/slurm draft_ckpt), or start torchrun on each node yourself "
            "(--nnodes, --node-rank, --master-addr, --master-port) with this same command"
        )
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 0)
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 0)
    if nodes != count or tasks != count:
        raise UserError(
            f"train.num_nodes is {count}, but this SLURM step has {nodes} node(s) and {tasks} "
            "task(s): it needs one task on each of train.num_nodes nodes"
        )
    step_nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    hosts = scontrol("show", "hostnames", step_nodes).split()
    if not hosts:
        raise UserError(f"scontrol could not expand this SLURM step's node list {step_nodes}")
    first = hosts[0]
    fields = scontrol_fields("show", "node", "-o", first)
    job = int(env["SLURM_JOB_ID"])
    return Node(
        count=count,
        rank=int(env["SLURM_NODEID"]),
        master_addr=fields.get("NodeAddr") or first,
        master_port=20000 + job % 20000,
        where=f"SLURM job {job}, node {env.get('SLURMD_NODENAME', '?')}",
    )


def launch_processes(
    module: str, argv: list[str], world: int, on_gpu: bool, node: Node | None = None
) -> None:
    """Run the entry script ``module`` under torchrun with ``world`` processes on this node,
    and wait; with ``node``, as this node's part of training over several."""
    package_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (package_root, env.get("PYTHONPATH")) if x)
    if not on_gpu:  # the job's threads (Snakemake sets these to them) shared out
        given = int(env.get("OMP_NUM_THREADS") or 0)
        each = max(1, given // world) if given else threads_per_process(world)
        env.update({name: str(each) for name in THREAD_VARIABLES})
    where = ["--standalone"] if node is None else node.torchrun_args()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", *where,
        f"--nproc-per-node={world}", "-m", module, *argv,
    ]  # fmt: skip
    if node is None:
        log.info("starting %d training processes: %s", world, shlex.join(cmd))
    else:
        log.info(
            "node %d of %d (%s): starting %d training processes: %s",
            node.rank, node.count, node.where, world, shlex.join(cmd),
        )  # fmt: skip
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        if node is not None:
            log.error(
                "node %d of %d (%s): its training processes stopped (exit status %d): one of "
                "them failed, or a process on another node did and broke the process group; "
                "the first error in this log is the cause. The same command resumes from the "
                "last checkpoint", node.rank, node.count, node.where, rc,
            )  # fmt: skip
        raise SystemExit(rc)
