"""train: extraction manifest + vocab map + verifier head -> EAGLE-3 draft checkpoint.

    python -m workflow_scripts.stages.train --manifest ... --vocab-map ... --verifier ... \\
        --state-dir ... --draft ... --metrics ... <every train.* parameter>

1. Checks every input before anything expensive (``lib/training/inputs.py``), and the GPUs it
   was given.
2. Reads only the embedding, the final norm and the draft vocabulary's lm_head rows from the
   verifier's safetensors (sharded checkpoints through their index); never the whole verifier.
3. Streams samples from the memory-mapped shards (``lib/training/loader.py``); with
   ``extract.disk_budget``, runs the engine that computes them while it trains, within the
   budget (``lib/training/stream_consumer.py``).
4. With ``num_gpus`` > 1 (or ``num_cpu_processes`` > 1 on the CPU) it starts itself under
   torchrun and trains with DDP (``lib/training/processes.py``). With ``num_nodes`` > 1 it runs
   once on each node of a SLURM job (srun, ``lib/workflow/nodes.py``), each starting that
   node's torchrun; the processes check that every node sees the same inputs, and share out
   the shards' checksums.
5. Trains, resumes, validates, logs and writes the draft and the metrics
   (``lib/training/trainer.py``).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from workflow_scripts.lib.common import UserError, run_main
from workflow_scripts.lib.training.inputs import check_inputs, check_same_view
from workflow_scripts.lib.training.processes import (
    launch_processes,
    setup_processes,
    slurm_node,
)
from workflow_scripts.lib.training.stream_consumer import ENGINE_GPUS, engine_command
from workflow_scripts.lib.training.trainer import Trainer
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.registry import STAGES


def split_gpus(io, p) -> None:
    """extract.disk_budget on GPUs: the job's GPUs (CUDA_VISIBLE_DEVICES, given by its rule's
    ``gpu`` resource: training's plus the engine's) shared out: training the first
    train.num_gpus, the engine the next ones, or the first of training's with
    extract.share_training_gpus."""
    _, _, ep = engine_command(io.engine_cmd)
    if not ep.use_gpus or ENGINE_GPUS in os.environ:
        return
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    need = p.job_gpus(ep)
    if len(visible) < need:
        raise UserError(
            f"train.num_gpus {p.num_gpus} and the engine's {ep.gpus} GPU(s) (extract."
            f"tensor_parallel_size{', shared' if ep.share_training_gpus else ''}) need {need} "
            f"GPUs, but the job sees {len(visible)} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); reserve more (snakemake "
            "--resources gpu=N) or lower them"
        )
    engine = visible[: ep.gpus] if ep.share_training_gpus else visible[p.num_gpus : need]
    os.environ[ENGINE_GPUS] = ",".join(engine)
    if p.num_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[: p.num_gpus])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    io, p = cli.parse("train", argv)
    if io.engine_cmd:
        split_gpus(io, p)
    nodes = p.num_nodes > 1
    if (p.processes_per_node > 1 or nodes) and "LOCAL_RANK" not in os.environ:
        node = slurm_node(p.num_nodes) if nodes else None
        # every input problem is reported here, before any process starts; over several
        # nodes the processes share the checksums out (check_inputs below)
        check_inputs(io, p, verify_checksums=not nodes)
        launch_processes(STAGES["train"].module, argv, p.processes_per_node, p.num_gpus > 0, node)
        return
    d = setup_processes(p)
    try:
        inputs = check_inputs(io, p, d=d if nodes else None)
        if nodes:
            check_same_view(inputs, d)
        Trainer(io, p, inputs, d).run()
    finally:
        if d.distributed and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
