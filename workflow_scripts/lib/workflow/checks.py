"""The dry-run's checks that need only the config: what is allowed but probably not meant
(``warnings_for``), the GPUs each job asks for against what Snakemake and a node give
(``check_gpu_counts``), and the global batch against the prepared data (``check_global_batch``).
The refusals of a combination of keys are the config's own, when it loads (lib/workflow/config.py,
``CROSS_KEY``); the checks against the verifier's files and this machine are
lib/verifier/preflight.py's, against the cluster lib/verifier/cluster.py's; lib/dryrun.py makes
them all in order, and a problem of a stage no requested target needs is a warning
(lib/targets.py).
"""

from __future__ import annotations

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.targets import DEFAULT_TARGET, by_targets
from workflow_scripts.lib.workflow.config import WorkflowConfig


def warnings_for(cfg: WorkflowConfig) -> list[str]:
    """What is allowed but probably not meant (needs no verifier)."""
    found = []
    budget, longest = cfg.train.micro_batch_budget_tokens, cfg.prepare.max_seq_len_tokens
    if budget < longest:
        found.append(
            f"train.micro_batch_budget_tokens {budget} is below prepare.max_seq_len_tokens "
            f"{longest}: samples longer than {budget} tokens are cut to it in training (raise "
            "train.micro_batch_budget_tokens to train on whole samples)"
        )
    ttt, k = cfg.train.ttt_steps, cfg.evaluate.num_speculative_tokens
    if k > ttt:
        found.append(
            f"evaluate.num_speculative_tokens {k} is above train.ttt_steps {ttt}: draft "
            f"positions {ttt + 1}..{k} are served untrained (raise train.ttt_steps, or lower "
            "evaluate.num_speculative_tokens)"
        )
    return found


def gpu_asks(cfg: WorkflowConfig) -> dict[str, int]:
    """The GPUs each GPU job asks for, by the config keys that set them."""

    def engine(section: str) -> tuple[str, int]:
        settings = getattr(cfg, section)
        key = f"{section}.tensor_parallel_size"
        if settings.pipeline_parallel_size > 1:
            key += f" x {section}.pipeline_parallel_size"
        return key, settings.gpus

    asks = dict([engine("extract"), ("train.num_gpus", cfg.train.num_gpus), engine("evaluate")])
    if cfg.extract.disk_budget is not None and cfg.extract.gpus:  # the engine runs with training
        key, _ = engine("extract")
        if cfg.extract.share_training_gpus:
            asks["train.num_gpus"] = cfg.train.job_gpus(cfg.extract)
        else:
            del asks["train.num_gpus"]
            asks[f"train.num_gpus + {key} (extract.disk_budget)"] = cfg.train.job_gpus(cfg.extract)
    if cfg.regenerate.enabled:
        asks.update([engine("regenerate")])
    return asks


def check_gpu_counts(
    cfg: WorkflowConfig,
    available: int | None,
    targets: list[str] | tuple[str, ...] = (DEFAULT_TARGET,),
) -> list[str]:
    """Every GPU job's GPUs against what Snakemake may give (``available``: --resources gpu=N),
    and what a node has (``gpus_per_node``): Snakemake would cap a job silently, and the job
    would fail when it starts, after every stage before it had run. Raises for the jobs the
    requested ``targets`` need; returns warnings for the others (``by_targets``)."""
    problems: dict[str, list[str]] = {}  # by stage: each key is <stage>.<setting>
    for key, n in gpu_asks(cfg).items():
        stage = key.split(".")[0]
        found = problems.setdefault(stage, [])
        if stage == "train":  # train.num_gpus: on each node
            nodes, total = cfg.train.num_nodes, n * cfg.train.num_nodes
            total_key = key if nodes == 1 else f"{key} x train.num_nodes"
            per_node, per_node_key = n, key
        else:  # an engine's GPUs: over all its nodes
            nodes, total, total_key = getattr(cfg, stage).num_nodes, n, key
            per_node, per_node_key = n // nodes, key if nodes == 1 else f"{key} / {stage}.num_nodes"
        if available is not None and total > available:
            found.append(
                f"{total_key} is {total} GPUs, but snakemake --resources gpu={available} gives "
                f"at most {available}; lower {key.split(' x ')[0]}, or give Snakemake more GPUs"
            )
        if cfg.gpus_per_node is not None and per_node > cfg.gpus_per_node:
            where = "a job runs on one node" if nodes == 1 else "that many run on each node"
            more = "" if stage == "train" or nodes == 1 else f", or raise {stage}.num_nodes"
            found.append(
                f"{per_node_key} is {per_node} GPUs, but a node has {cfg.gpus_per_node} "
                f"(gpus_per_node) and {where}; lower {key.split(' x ')[0]}{more}"
            )
    errors, warnings = by_targets(problems, targets)
    if errors:
        raise UserError("\n".join(errors))
    return warnings


def check_global_batch(
    cfg: WorkflowConfig,
    samples: int | None,
    targets: list[str] | tuple[str, ...] = (DEFAULT_TARGET,),
) -> list[str]:
    """The global batch against the prepared data (``samples``: prepare's rows, once its stats
    exist): every micro-batch of every process holds one sample at least, so a training split
    smaller than num_nodes x processes per node x grad_accum_steps cannot fill one step."""
    t = cfg.train
    per_node = t.processes_per_node
    micro = t.num_nodes * per_node * t.grad_accum_steps
    found = []
    if samples is not None:
        train_samples = samples - round(samples * t.validation_fraction)
        if train_samples < micro:
            key = "train.num_gpus" if t.num_gpus > 0 else "train.num_cpu_processes"
            found.append(
                f"the training split (about {train_samples} of the {samples} prepared samples) "
                f"cannot fill one global batch of {micro} micro-batches (train.num_nodes "
                f"{t.num_nodes} x {key} {per_node} x train.grad_accum_steps "
                f"{t.grad_accum_steps}, one sample each at least); lower them, or add data"
            )
    errors, warnings = by_targets({"train": found} if found else {}, targets)
    if errors:
        raise UserError("\n".join(errors))
    return warnings
