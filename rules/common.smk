# Config loading and validation, paths, and the command lines that the stages' jobs run.
import json
import os
import sys
from pathlib import Path

import yaml

from snakemake.exceptions import WorkflowError

WORKFLOW_DIR = Path(workflow.basedir)
sys.path.insert(0, str(WORKFLOW_DIR))
from workflow_scripts.lib import cli as _cli
from workflow_scripts.lib.code_inputs import closure_files
from workflow_scripts.lib.config import ConfigError, load_config
from workflow_scripts.lib.registry import STAGES

try:
    CFG = load_config(config)
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None

RESULTS = Path(CFG.results_dir)
LOGS = RESULTS / "logs"
BENCHMARKS = RESULTS / "benchmarks"
DEMO = RESULTS / "demo"

VERIFIER_DIR = Path(CFG.verifier) if CFG.verifier else DEMO / "verifier"
VERIFIER_CONFIG = VERIFIER_DIR / "config.json"
CHAT_DATA = Path(CFG.chat_data) if CFG.chat_data else DEMO / "chat_data.jsonl"
EVAL_PROMPTS = Path(CFG.eval_prompts) if CFG.eval_prompts else DEMO / "eval_prompts.jsonl"
# the verifier's weight files are inputs of the stages that run it: new weights, new outputs
VERIFIER_WEIGHTS = (
    sorted(
        str(path)
        for pattern in ("*.safetensors", "pytorch_model*.bin")
        for path in VERIFIER_DIR.glob(pattern)
    )
    if CFG.verifier
    else [DEMO / "verifier" / "model.safetensors"]
)
# what prepare tokenizes: chat_data, or the verifier's own answers to it (regenerate.enabled)
REGENERATED_CHAT_DATA = RESULTS / "regenerate" / "chat_data.jsonl"
PREPARE_CHAT_DATA = REGENERATED_CHAT_DATA if CFG.regenerate.enabled else CHAT_DATA


def stage_code(stage):
    """The code the stage runs (an input of its rules, so an edit reruns the stage): every
    module of the project in the import closure of the stage's entry script, found by
    lib/code_inputs.py. Relative to the working directory, so that moving the checkout does not
    rerun everything."""
    return [os.path.relpath(f) for f in closure_files(STAGES[stage].module, WORKFLOW_DIR)]


def stage_config(stage):
    """The stage's whole config slice, as one param: Snakemake records it, so a change to any
    of the stage's settings reruns exactly the rules that take that slice (and what follows)."""
    return json.dumps(
        getattr(CFG, STAGES[stage].config_key).model_dump(mode="json"), sort_keys=True
    )


def stage_cmd(stage, gpus=None, **extra):
    """A params function: the stage's whole command, `python -m <module> <args>`, rendered
    from its config slice and the named input, output and wildcards (plus ``extra`` values).
    `python` is the active environment's (.venv, or the conda env a rule is given). Snakemake does not
    record params computed from input/output, hence stage_config beside it.

    ``gpus``: for a GPU rule, the same count as its ``resources`` entry ``gpu`` (an int,
    or a function of the wildcards). The command then runs under workflow_scripts/lib/gpus.py, which
    gives the job exactly that many GPUs of its own in CUDA_VISIBLE_DEVICES (a lease on local
    runs, SLURM's allocation on a cluster) and fails before the stage starts when there are
    fewer; with 0 the command runs unchanged."""
    spec = STAGES[stage]
    params = getattr(CFG, spec.config_key) if spec.config_key else None

    def render(wildcards, input, output):
        files = {**dict(wildcards.items()), **dict(input.items()), **dict(output.items())}
        args = _cli.render(stage, params, {**files, **extra})
        cmd = f"python -m {spec.module} {args}"
        if gpus is not None:
            count = gpus(wildcards) if callable(gpus) else gpus
            cmd = f"python -m workflow_scripts.lib.gpus {int(count)} -- {cmd}"
        return cmd

    return render
