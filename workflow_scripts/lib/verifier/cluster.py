"""The jobs that span several nodes (training over ``train.num_nodes``; an engine stage's verifier
over ``<stage>.num_nodes``) checked at dry-run against what they would get: the profile's
resources for their rules (a set-resources entry replaces the rule's own) and the SLURM cluster's
nodes (``sinfo``). No torch, no vLLM: part of the dry-run's seconds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.targets import DEFAULT_TARGET, by_targets


@dataclass(frozen=True)
class NodeJob:
    """One kind of job that may span nodes: its rule, the stage its settings belong to, its node
    count (config key ``key``) and the GPUs it takes on each node (config key ``gpus_key``)."""

    rule: str
    stage: str
    key: str
    nodes: int
    gpus_key: str
    gpus_per_node: int


def node_jobs(cfg) -> list[NodeJob]:
    """The jobs of ``cfg`` that may span nodes, in the workflow's order."""
    jobs = []
    engines = [("regenerate", "regenerate")] if cfg.regenerate.enabled else []
    if cfg.extract.backend == "vllm" and cfg.extract.disk_budget is None:
        engines.append(("extract", "extract"))
    for rule, section in engines:
        p = getattr(cfg, section)
        gpus_key = f"{section}.tensor_parallel_size / {section}.num_nodes"
        jobs.append(
            NodeJob(rule, section, f"{section}.num_nodes", p.num_nodes, gpus_key, p.gpus_per_node)
        )
    t = cfg.train
    jobs.append(
        NodeJob("train", "train", "train.num_nodes", t.num_nodes, "train.num_gpus", t.num_gpus)
    )
    e = cfg.evaluate
    gpus_key = "evaluate.tensor_parallel_size / evaluate.num_nodes"
    for rule in ("evaluate_reference", "evaluate_draft"):  # the same engine settings
        jobs.append(
            NodeJob(rule, "evaluate", "evaluate.num_nodes", e.num_nodes, gpus_key, e.gpus_per_node)
        )
    return jobs


def spans_nodes(cfg) -> bool:
    """Whether any job of ``cfg`` spans several nodes (then the dry-run asks SLURM)."""
    return any(job.nodes > 1 for job in node_jobs(cfg)) or cfg.extract.num_nodes > 1


def unsupported(cfg) -> dict[str, list[str]]:
    """Engines over several nodes where this workflow does not run them, by stage."""
    found: dict[str, list[str]] = {}
    x = cfg.extract
    if x.num_nodes > 1 and x.backend != "vllm":
        found.setdefault("extract", []).append(
            f"extract.num_nodes is {x.num_nodes} with extract.backend {x.backend}: only the vLLM "
            "engine runs over several nodes; set extract.backend: vllm or extract.num_nodes: 1"
        )
    elif x.num_nodes > 1 and x.disk_budget is not None:
        found.setdefault("extract", []).append(
            f"extract.num_nodes is {x.num_nodes} with extract.disk_budget: within a disk budget "
            "the engine runs inside the training job, on its nodes, and an engine over several "
            "nodes does not; set extract.disk_budget: null (the shards are then written in "
            "full first) or extract.num_nodes: 1"
        )
    return found


def check_node_counts(
    cfg,
    overrides: dict[str, dict[str, Any]],
    cluster: dict[str, Any] | None,
    targets: list[str] | tuple[str, ...] = (DEFAULT_TARGET,),
) -> list[str]:
    """Each job over several nodes against what it will get: the profile's resources for its
    rule (``overrides``: rule -> the set-resources entry, which replaces the rule's own nodes and
    tasks), and the SLURM cluster (``cluster``: its node count and most GPUs on a node, from
    sinfo; None where there is no SLURM here, which is warned of only: nothing to check
    against). Raises for the stages the requested ``targets`` need; returns warnings for the
    others."""
    problems = unsupported(cfg)
    unknown: list[str] = []  # what cannot be checked here: a warning whatever the targets
    for job in node_jobs(cfg):
        n, found = job.nodes, problems.setdefault(job.stage, [])
        given = overrides.get(job.rule) or {}
        for name in ("nodes", "tasks"):
            got = given.get(name)
            if got is not None and (n > 1 or name == "nodes") and int(got) != n:
                found.append(
                    f"{job.key} is {n}, but the profile sets {name}: {got} for rule {job.rule} "
                    f"(set-resources; it replaces the rule's own {name}: {n}): remove it from "
                    "the profile"
                )
        if n == 1:
            continue
        if cluster is None:
            unknown.append(
                f"{job.key} is {n}: the {job.rule} job runs in a SLURM job of {n} nodes, and "
                "SLURM cannot be reached here (no sinfo) to check that it has them; run with the "
                "SLURM profile on the cluster (the job stops at once outside SLURM)"
            )
            continue
        where = f" in partition {cluster['partition']}" if cluster.get("partition") else ""
        if cluster["nodes"] < n:
            found.append(
                f"{job.key} is {n}, but SLURM has {cluster['nodes']} node(s){where}; lower {job.key}"
            )
        if job.gpus_per_node > cluster["gpus_per_node"]:
            found.append(
                f"{job.gpus_key} is {job.gpus_per_node} GPUs on each of {job.key} {n} nodes, but "
                f"SLURM's nodes{where} have at most {cluster['gpus_per_node']}; lower "
                f"{job.gpus_key.split(' / ')[0]}"
            )
    # (the two evaluate rules find the same problems of the cluster: each said once)
    errors, warnings = by_targets(
        {s: list(dict.fromkeys(f)) for s, f in problems.items() if f}, targets
    )
    if errors:
        raise UserError("\n".join(errors))
    return warnings + list(dict.fromkeys(unknown))


def slurm_cluster(partition: str | None, timeout_s: float = 10) -> dict[str, Any] | None:
    """The SLURM cluster's node count and most GPUs on one node (of ``partition``, or all), from
    ``sinfo``; None where there is no SLURM here."""
    if shutil.which("sinfo") is None:
        return None
    cmd = ["sinfo", "-h", "-N", "-o", "%N %G", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    nodes: dict[str, int] = {}
    for line in out.stdout.splitlines():
        name, _, gres = line.partition(" ")
        gpus = [int(m) for m in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)]
        nodes[name] = max(nodes.get(name, 0), sum(gpus))
    return {
        "nodes": len(nodes),
        "gpus_per_node": max(nodes.values(), default=0),
        "partition": partition,
    }
