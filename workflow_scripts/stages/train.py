"""train: extraction manifest + vocab map + verifier head -> EAGLE-3 draft checkpoint.

    python -m workflow_scripts.stages.train --manifest ... --vocab-map ... --verifier ... \\
        --state-dir ... --draft ... --metrics ... <every train.* parameter>

1. Checks every input before anything expensive (``lib/training/inputs.py``), and the GPUs it
   was given.
2. Reads only the embedding, the final norm and the draft vocabulary's lm_head rows from the
   verifier's safetensors (sharded checkpoints through their index); never the whole verifier.
3. Streams samples from the memory-mapped shards (``lib/training/data.py``).
4. With ``num_gpus`` > 1 (or ``num_cpu_processes`` > 1 on the CPU) it starts itself under
   torchrun and trains with DDP (``lib/training/processes.py``).
5. Trains, resumes, validates, logs and writes the draft and the metrics
   (``lib/training/trainer.py``).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.training.inputs import check_inputs
from workflow_scripts.lib.training.processes import launch_processes, setup_processes
from workflow_scripts.lib.training.trainer import Trainer
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.registry import STAGES


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    io, p = cli.parse("train", argv)
    wanted = p.num_gpus if p.num_gpus > 0 else p.num_cpu_processes
    if wanted > 1 and "LOCAL_RANK" not in os.environ:
        check_inputs(io, p)  # every input problem is reported here, before any process starts
        launch_processes(STAGES["train"].module, argv, wanted, on_gpu=p.num_gpus > 0)
        return
    d = setup_processes(p)
    try:
        inputs = check_inputs(io, p)
        Trainer(io, p, inputs, d).run()
    finally:
        if d.distributed and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
