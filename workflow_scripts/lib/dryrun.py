"""What the dry-run checks and works out before any job runs, in one call for the rules
(rules/common.smk: ``check_run``): every check of the config against the requested targets, this
machine, the cluster, the verifier and the environment the jobs run; the sources' files the rules
take as inputs; and the run's estimate. Plain Python, tested without Snakemake (but for reading
Snakemake's command line, ``requested_targets``). A problem of a stage no requested target needs
is a warning, not an error (lib/targets.py: ``by_targets``); each job checks again.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.targets import DEFAULT_TARGET, by_targets
from workflow_scripts.lib.data.resolve import input_files, resolve_sources
from workflow_scripts.lib.draft.export import ENGINES, DraftShape, serving_problems
from workflow_scripts.lib.hidden_states.estimate import dry_run_report
from workflow_scripts.lib.training import disk_budget, init_from
from workflow_scripts.lib.verifier import cluster, environment, preflight
from workflow_scripts.lib.verifier.engine import resolve_dtype
from workflow_scripts.lib.verifier.files import aux_layer_ids, verifier_config, weight_files
from workflow_scripts.lib.workflow import checks
from workflow_scripts.lib.workflow.code_inputs import shard_code_fingerprint
from workflow_scripts.lib.workflow.config import WorkflowConfig
from workflow_scripts.lib.workflow.definitions import EngineSettings
from workflow_scripts.lib.workflow.layout import Layout
from workflow_scripts.lib.workflow.records import PrepareStats
from workflow_scripts.lib.workflow.registry import STAGES


def requested_targets(argv: list[str] | None = None) -> list[str]:
    """What this run of Snakemake was asked to build, from the command line it was started with
    (``sys.argv``), read as Snakemake's own command line reads it (snakemake.cli.parse_args, with
    the profile's settings): its targets, the rules it is told to force or to run until
    (Snakemake adds them to the targets) and the rules of its target jobs (what a cluster job
    runs); the default target, all, when none, or when Snakemake was not started from its
    command line (its Python API): every stage is then checked, as for all."""
    argv = sys.argv if argv is None else argv
    program = Path(argv[0]) if argv else Path()
    if program.name != "snakemake" and program.parent.name != "snakemake":
        return [DEFAULT_TARGET]
    from snakemake.cli import parse_args

    with contextlib.redirect_stderr(io.StringIO()):  # the profiles it reads, said once already
        _, args = parse_args(argv[1:])
    targets = [*(args.targets or ()), *(args.forcerun or ()), *(args.until or ())]
    jobs = [getattr(job, "rulename", str(job).split(":")[0]) for job in args.target_jobs or ()]
    return [*targets, *jobs] or [DEFAULT_TARGET]


def gpus_asked(cfg: WorkflowConfig) -> int:
    """The GPUs the config's jobs ask for, together (0: a CPU run)."""
    return sum(checks.gpu_asks(cfg).values())


@dataclass
class Run:
    """What the rules take from the dry-run's checks."""

    verifier_dir: Path
    verifier_cfg: dict  # its config.json; {} for the embedded default's (built by the workflow)
    data_files: list  # the chat data's source files (the data rule's inputs)
    eval_files: list  # the evaluation prompts' files
    init_from_files: list  # train.init_from's draft files
    verifier_weights: list  # the verifier's weight files (inputs of the rules that run it)
    gpus: int  # the GPUs the config's jobs ask for, together (0: a CPU run)
    say: Callable[[str, str], None]  # says ("info" or "warning", text) to the user, at once

    def warn(self, texts: list[str]) -> None:
        for text in texts:
            self.say("warning", text)


def _demoted(stage: str, exc: UserError, targets: list[str], run: Run) -> None:
    """``exc``, a problem of ``stage``: raised where a requested target needs the stage, a
    warning otherwise."""
    errors, later = by_targets({stage: [str(exc)]}, targets)
    if errors:
        raise UserError("\n".join(errors)) from None
    run.warn(later)


def check_run(
    cfg: WorkflowConfig,
    targets: list[str],
    layout: Layout,
    *,
    gpu_limit: int | None,
    profile_resources: Callable[[str], dict],
    default_partition: str | None,
    own_python: str | None,
    estimate: bool,
    versions: dict[str, str] | None,
    say: Callable[[str, str], None],
) -> Run:
    """Every check and resolution the dry-run makes, in order; a UserError, its message for the
    user, where the run cannot go on. ``gpu_limit``: --resources gpu=N; ``profile_resources``:
    a rule's resources as the profile or the command line give them; ``own_python``: the
    interpreter the jobs run where it is Snakemake's own (not under --sdm conda or apptainer);
    ``estimate``: print the run's estimate (the main process); ``versions``: the packages'
    versions the jobs run with (lib/workflow/code_inputs.py), None for the installed ones;
    ``say``: tells the user ("info" or "warning", text), as the checks go. Sets cfg's chat_data and eval_prompts to the sources as the jobs read them.
    """
    # Every GPU job's GPUs against --resources gpu=N and gpus_per_node, now: Snakemake would cap
    # a job silently, and the job would fail when it starts.
    try:
        warnings = checks.check_gpu_counts(cfg, gpu_limit, targets)
    except UserError as exc:
        raise UserError(f"the config asks for more GPUs than there are:\n  {exc}") from None
    # The jobs over several nodes against what they would get: the profile's resources for their
    # rules, and SLURM's nodes (sinfo, in the profile's partition), asked only when a job spans
    # several nodes.
    try:
        given = {job.rule: profile_resources(job.rule) for job in cluster.node_jobs(cfg)}
        partition = given["train"].get("slurm_partition") or default_partition
        warnings += cluster.check_node_counts(
            cfg,
            given,
            cluster.slurm_cluster(partition) if cluster.spans_nodes(cfg) else None,
            targets,
        )
    except UserError as exc:
        raise UserError(f"the config asks for more nodes than there are:\n  {exc}") from None
    # The global batch against the prepared samples, once prepare has counted them.
    try:
        rows = PrepareStats.read(layout.prepare.stats).rows_out
    except UserError:  # not made yet, or by other code: prepare runs first
        rows = None
    try:
        warnings += checks.check_global_batch(cfg, rows, targets)
    except UserError as exc:
        raise UserError(f"the batch does not fit the data:\n  {exc}") from None
    # Every check that needs only the config and the verifier's files, when the verifier is on
    # disk (a verifier named in the config; the embedded default's is built by the workflow and
    # checked by its jobs).
    verifier_cfg = {}
    if cfg.verifier is not None:
        if not Path(cfg.verifier).is_dir():
            raise UserError(
                f"config key 'verifier': {cfg.verifier} is not a directory (a Hugging Face model "
                "directory with config.json, weights and tokenizer)"
            )
        try:
            warnings += checks.warnings_for(cfg) + preflight.check_workflow(
                cfg, cfg.verifier, targets
            )
        except UserError as exc:
            raise UserError(
                f"the config does not fit the verifier {cfg.verifier}:\n  "
                + str(exc).replace("\n", "\n  ")
            ) from None
        verifier_cfg = verifier_config(cfg.verifier)
    else:
        warnings += checks.warnings_for(cfg)
    run = Run(
        verifier_dir=layout.verifier(cfg.verifier),
        verifier_cfg=verifier_cfg,
        data_files=[],
        eval_files=[],
        init_from_files=[],
        verifier_weights=verifier_weights(cfg, layout),
        gpus=gpus_asked(cfg),
        say=say,
    )
    run.warn(warnings)
    _sources(cfg, targets, layout, run)
    # train.init_from: the draft training starts from, checked against training's settings and
    # the verifier where it is on disk; its files are the train rule's inputs
    try:
        run.init_from_files = init_from.files(cfg.train.init_from, layout.train.dir)
        if run.init_from_files and verifier_cfg:
            ids = aux_layer_ids(verifier_cfg, cfg.extract.aux_layer_ids)
            init_from.check_init_draft(cfg.train.init_from, cfg.train, verifier_cfg, ids)
    except UserError as exc:
        run.init_from_files = []
        _demoted("train", exc, targets, run)
    _engines(cfg, targets, layout, run, say_which=estimate)
    if estimate:
        _estimate(cfg, targets, layout, run, versions)
    # The GPU jobs against the environment the jobs run, when it is Snakemake's own: its CPU
    # build would be refused by each GPU job only once it started.
    if own_python is not None:
        problems = environment.gpu_build_problems(
            checks.gpu_asks(cfg), environment.cpu_build(), own_python
        )
        errors, later = by_targets(problems, targets)
        if errors:
            raise UserError("\n".join(errors))
        run.warn(later)
    if cfg.extract.disk_budget is not None:
        _disk_budget(cfg, targets, layout, run)
    return run


def verifier_weights(cfg: WorkflowConfig, layout: Layout) -> list[str]:
    """The verifier's weight files, inputs of the stages that run it: new weights, new outputs.
    The embedded default's is the one file the demo stage writes."""
    if not cfg.verifier:
        return [str(layout.demo.verifier / "model.safetensors")]
    try:
        return sorted(str(path) for path in weight_files(cfg.verifier))
    except UserError:  # named by the verifier checks, for the targets that need it
        return []


def _sources(cfg: WorkflowConfig, targets: list[str], layout: Layout, run: Run) -> None:
    """The sources of chat_data and eval_prompts as the jobs read them (lib/data/resolve.py): the
    embedded default's files where none is named, sets known by name at their place, hub datasets
    pinned to the commit recorded in sources.lock.json; their files are the rules' inputs."""
    cfg.data.chat_data, cfg.evaluate.eval_prompts, warnings = resolve_sources(
        cfg.data.chat_data, cfg.evaluate.eval_prompts, layout.demo.dir, layout.sources_lock
    )
    demo_files = (layout.demo.chat_data, layout.demo.eval_prompts)
    run.data_files = input_files(cfg.data.chat_data.root, "chat_data", demo_files)
    try:  # a problem of the evaluation's prompts stops only the targets that evaluate
        run.eval_files = input_files(cfg.evaluate.eval_prompts.root, "eval_prompts", demo_files)
    except UserError as exc:
        errors, later = by_targets({"evaluate": [str(exc)]}, targets)
        if errors:
            raise UserError("\n".join(errors)) from None
        warnings += later
    run.warn(warnings)


ENGINES_DOC = "docs/gpu-and-slurm.md#serving-on-sglang-and-tensorrt-llm"


def _engines(
    cfg: WorkflowConfig, targets: list[str], layout: Layout, run: Run, say_which: bool
) -> None:
    """Which engines serve the draft the config trains (lib/draft/export.py): said when
    ``say_which``; an export target for an engine that cannot is refused, saying why."""
    t = cfg.train
    ids = cfg.extract.aux_layer_ids
    if ids is None and run.verifier_cfg:
        ids = aux_layer_ids(run.verifier_cfg, None)
    shape = DraftShape(
        layer="mla" if t.draft_attention == "mla" else t.draft_layer,
        num_layers=t.num_draft_layers,
        aux_layer_ids=None if ids is None else tuple(ids),
        sliding_window=t.sliding_window_tokens,
        norm_before_residual=t.norm_before_residual,
    )
    problems = {engine: serving_problems(shape, engine) for engine in ENGINES}
    for engine, found in problems.items():
        export_dir = str(layout.export.draft(engine))
        if found and any(x == f"export_{engine}" or x.startswith(export_dir) for x in targets):
            raise UserError(
                f"target export_{engine} cannot be built: {ENGINES[engine]} cannot serve the "
                "draft this config trains as it is trained:\n  " + "\n  ".join(found)
            )
    if say_which:
        can = ["vLLM"] + [ENGINES[e] for e, found in problems.items() if not found]
        keys = {e: ", ".join(why.split(":")[0] for why in found) for e, found in problems.items()}
        by_keys = {}  # engines refused for the same keys, together
        for engine, why in keys.items():
            if why:
                by_keys.setdefault(why, []).append(ENGINES[engine])
        line = f"the draft will be served by {' and '.join(can)}"
        if by_keys:
            cannot = "; ".join(f"{' nor '.join(names)} ({why})" for why, names in by_keys.items())
            line += f"; not by {cannot}: {ENGINES_DOC}"
        run.say("info", line)


def _estimate(
    cfg: WorkflowConfig,
    targets: list[str],
    layout: Layout,
    run: Run,
    versions: dict[str, str] | None,
) -> None:
    """The run's estimate (lib/hidden_states/estimate.py): for a target that extracts, the
    verifier tokens and the hidden states' bytes on disk from prepare's counts, against the free
    space, or how to get it early. Then what a change of the code or the vLLM that computes
    hidden states will cost: shards made by other code are computed again."""
    chat_data = layout.regenerate.chat_data if cfg.regenerate.enabled else layout.data.chat_data
    lines, warnings = dry_run_report(cfg, targets, layout, run.verifier_dir, chat_data)
    if lines:
        run.say("info", "\n".join(lines))
    run.warn(warnings)
    manifest = layout.extract.manifest
    if manifest.exists():
        made = json.loads(manifest.read_text())
        if made.get("made_by", {}).get("code") != shard_code_fingerprint(versions=versions):
            run.warn(
                [
                    f"the code or the vLLM that computes hidden states changed since the shards "
                    f"of {manifest} were made: when extraction runs, it computes all "
                    f"{len(made['shards'])} of them again ({made['bytes'] / 1e9:.3g} GB). To keep "
                    "them instead: docs/gpu-and-slurm.md#after-an-upgrade"
                ]
            )


def _disk_budget(cfg: WorkflowConfig, targets: list[str], layout: Layout, run: Run) -> None:
    """extract.disk_budget against the stream plan, where it exists (made by the extract_plan
    job; otherwise the train job makes the same check before the engine starts): the costs
    logged, a budget below what training needs at once refused, now."""
    plan, shard_dir = layout.extract.stream_plan, layout.extract.stream_shards
    if not plan.is_file():
        if layout.prepare.tokenized.is_file():
            run.say(
                "info",
                f"hidden states: extract.disk_budget's plan is made by `snakemake {plan}` (it "
                "reads the tokenized data, loads no model); a dry-run then shows its costs",
            )
        return
    try:
        costs = disk_budget.plan_costs(
            disk_budget.load_stream_plan(plan), cfg.train, cfg.extract, shard_dir
        )
    except UserError as exc:
        _demoted("train", exc, targets, run)
        return
    run.say("info", f"hidden states: {disk_budget.describe(costs)}")


def recorded_settings(
    cfg: WorkflowConfig, stage: str, verifier_cfg: dict, job_layout: bool = False
) -> str:
    """The stage's result settings (lib/workflow/definitions.py) as the rules record them (one
    JSON param): ``dtype`` auto as the dtype it resolves to (which use_gpus decides);
    ``job_layout``, for the rule of a stage's data-parallel jobs: also the settings that decide
    which job files exist (job counts)."""
    params = getattr(cfg, STAGES[stage].config_key)
    settings = params.result_settings()
    if isinstance(params, EngineSettings):
        settings["dtype"] = resolve_dtype(params, verifier_cfg)
    if job_layout:
        settings.update({name: getattr(params, name) for name in params.JOB_LAYOUT})
    return json.dumps(settings, sort_keys=True)


def resolved_config(cfg: WorkflowConfig, verifier_cfg: dict) -> dict:
    """The settings that decide the results: the top-level keys and every stage's result
    settings, defaults filled in (what <results_dir>/config.resolved.yaml records)."""
    top = {k: v for k, v in cfg.model_dump(mode="json").items() if not isinstance(v, dict)}
    stages = {
        spec.config_key: json.loads(recorded_settings(cfg, name, verifier_cfg))
        for name, spec in STAGES.items()
        if spec.config_key is not None
    }
    return {**top, **stages}
