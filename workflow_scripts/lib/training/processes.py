"""Training's processes: one, or several under torchrun with DDP (nccl on GPUs, gloo on the
CPU, whose cores are then shared out)."""

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
    wanted = p.num_gpus if p.num_gpus > 0 else p.num_cpu_processes
    if world != wanted:
        raise UserError(f"started as {world} process(es), the settings ask for {wanted}")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if p.num_gpus > 0:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # else torch already follows it
            torch.set_num_threads(threads_per_process(world))
    # a process group whenever torchrun started us, one process too (its NCCL path then runs)
    distributed = world > 1 or "TORCHELASTIC_RUN_ID" in os.environ
    if distributed:
        dist.init_process_group("nccl" if p.num_gpus > 0 else "gloo")
    return Dist(rank, world, local_rank, device, distributed)


def threads_per_process(world: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // world)


def launch_processes(module: str, argv: list[str], world: int, on_gpu: bool) -> None:
    """Run the entry script ``module`` under torchrun with ``world`` processes on this node,
    and wait."""
    package_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (package_root, env.get("PYTHONPATH")) if x)
    if not on_gpu:  # the CPU cores shared out (torchrun would give each process one)
        env.setdefault("OMP_NUM_THREADS", str(threads_per_process(world)))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", "-m", module, *argv,
    ]  # fmt: skip
    log.info("starting %d training processes: %s", world, shlex.join(cmd))
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise SystemExit(rc)
