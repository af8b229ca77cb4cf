"""Training over several nodes (train.num_nodes): the launchers, the checks at dry-run and at the
job's start, and two torchrun node ranks on localhost training the draft that one node of two
processes trains. The same over a real two-node SLURM: tests/test_slurm.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import multinode
from workflow_scripts.lib.common import UserError, sha256_file
from workflow_scripts.lib.verifier import cluster
from workflow_scripts.lib.workflow import checks, gpus, nodes
from workflow_scripts.lib.workflow.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def cfg(**train):
    return load_config({"train": train})


# ----------------------------------------------------------------- the launchers


def test_the_nodes_launcher_runs_one_node_as_is_and_refuses_several_outside_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    launcher = [sys.executable, "-m", "workflow_scripts.lib.workflow.nodes"]
    one = subprocess.run(
        [*launcher, "1", "--", "echo", "ran"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert one.returncode == 0 and one.stdout == "ran\n"
    two = subprocess.run(
        [*launcher, "2", "--", "echo", "ran"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert two.returncode == 2 and "ran" not in two.stdout
    assert "train.num_nodes is 2" in two.stderr and "--profile profiles/slurm" in two.stderr
    assert nodes.srun_command(2, ["x"]) == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "x",
    ]  # fmt: skip


def test_a_node_started_outside_a_slurm_step_is_refused_naming_the_setting():
    from workflow_scripts.lib.training.processes import slurm_node

    with pytest.raises(UserError, match="train.num_nodes is 2: the train stage runs once on each"):
        slurm_node(2, {"SLURM_JOB_ID": "7"})  # the job's batch step: no SLURM_STEP_ID
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NODEID": "0"}
    with pytest.raises(UserError, match="has 2 node.s. and 4 task.s.: it needs one task on each"):
        slurm_node(2, {**step, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4"})


def test_gpu_leases_are_per_node_of_a_slurm_job(tmp_path):
    env = {gpus.LOCK_DIR_ENV: str(tmp_path), "SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n1"}
    assert gpus.lock_dir(env) == tmp_path / "slurm-job-9-n1"


# ----------------------------------------------------------------- checked at dry-run


def test_node_counts_against_the_profile_and_the_cluster():
    two = cfg(num_nodes=2, num_gpus=8)
    slurm = {"nodes": 2, "gpus_per_node": 8, "partition": "gpu"}
    train = lambda **given: {"train": given}  # noqa: E731  the profile's set-resources for train
    assert cluster.check_node_counts(two, {}, slurm) == []
    assert cluster.check_node_counts(cfg(), train(nodes=1), None) == []  # one node: no SLURM
    refused = {
        "the profile sets nodes: 1 for rule train": (train(nodes=1), slurm, two),
        "the profile sets tasks: 1 for rule train": (train(tasks=1), slurm, two),
        "but SLURM has 2 node(s) in partition gpu; lower train.num_nodes": (
            {},
            slurm,
            cfg(num_nodes=3),
        ),
        "train.num_gpus is 8 GPUs on each of train.num_nodes 2 nodes, but SLURM's nodes in "
        "partition gpu have at most 4": ({}, {**slurm, "gpus_per_node": 4}, two),
    }
    for why, (overrides, where, config) in refused.items():
        with pytest.raises(UserError) as exc:
            cluster.check_node_counts(config, overrides, where)
        assert why in str(exc.value) and "train.num_nodes" in str(exc.value), str(exc.value)
    # no SLURM here: nothing to check against, a warning only (the job stops outside SLURM)
    (warning,) = cluster.check_node_counts(two, {}, None)
    assert "train.num_nodes is 2" in warning and "SLURM cannot be reached here" in warning
    # a target that needs no training: a warning
    (warning,) = cluster.check_node_counts(two, train(nodes=1), slurm, ["vocab_map"])
    assert "the profile sets nodes: 1" in warning


def test_the_jobs_checked_for_nodes_are_rules_of_the_workflow():
    """The dry-run checks a multi-node job against the profile's resources for its rule (by the
    rule's name): a rule renamed in rules/ and not in cluster.py would go unchecked."""
    files = [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))]
    rules = set(re.findall(r"^rule (\w+):", "\n".join(f.read_text() for f in files), re.M))
    config = load_config({"regenerate": {"enabled": True}})
    checked = {job.rule for job in cluster.node_jobs(config)}
    assert checked == {"regenerate", "extract", "train", "evaluate_reference", "evaluate_draft"}
    assert checked <= rules, checked - rules


def test_gpu_counts_over_nodes_are_totals_for_snakemake_and_per_node_for_a_node():
    config = load_config({"train": {"num_nodes": 2, "num_gpus": 8}, "gpus_per_node": 8})
    assert checks.check_gpu_counts(config, 16) == []
    with pytest.raises(UserError, match="train.num_gpus x train.num_nodes is 16 GPUs, but snake"):
        checks.check_gpu_counts(config, 8)
    config = load_config({"train": {"num_nodes": 2, "num_gpus": 8}, "gpus_per_node": 4})
    with pytest.raises(UserError, match="a node has 4 .gpus_per_node. and that many run on each"):
        checks.check_gpu_counts(config, None)


def test_a_disk_budget_over_several_nodes_is_refused():
    with pytest.raises(ValueError, match="train.num_nodes 2 with extract.disk_budget"):
        load_config({"train": {"num_nodes": 2}, "extract": {"disk_budget": "1TB"}})


# ----------------------------------------------------------------- checked at the job's start


VIEW_CASES = ("none", "inputs", "shards")  # what process 1 sees differently


def _view_worker(rank: int, port: int, out: Path) -> None:
    from workflow_scripts.lib.training.inputs import check_same_view
    from workflow_scripts.lib.training.processes import Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for differ in VIEW_CASES:
            shard = out / f"shard_{rank if differ == 'shards' else 0}.bin"  # 10 and 11 bytes
            fingerprint = f"f{rank}" if differ == "inputs" else "f"
            manifest = SimpleNamespace(shards=[SimpleNamespace(path=str(shard))])
            inputs = SimpleNamespace(fingerprint=fingerprint, manifest=manifest)
            try:
                check_same_view(inputs, Dist(rank=rank, world=2, distributed=True))
                said = "same"
            except UserError as exc:
                said = str(exc)
            (out / f"{differ}.rank{rank}.txt").write_text(said)
    finally:
        dist.destroy_process_group()


def test_every_process_must_see_the_same_inputs(tmp_path):
    for rank in range(2):
        (tmp_path / f"shard_{rank}.bin").write_bytes(b"x" * (10 + rank))
    mp.spawn(_view_worker, args=(multinode.free_port(), tmp_path), nprocs=2)
    for differ in VIEW_CASES:
        said = [(tmp_path / f"{differ}.rank{r}.txt").read_text() for r in range(2)]
        if differ == "none":
            assert said == ["same", "same"]
            continue
        what = "inputs" if differ == "inputs" else "shard files"
        assert said[0] == said[1] and "process 1 on " in said[0], said
        assert f"sees other {what} than process 0" in said[0]
        assert "Put results_dir (and the verifier) on a path every node mounts" in said[0]


# ----------------------------------------------------------------- the real thing


def test_two_nodes_on_localhost_train_the_one_node_draft(mechanics_build, one_node_draft, tmp_path):
    """2 nodes x 1 process (two torchrun node ranks meeting at 127.0.0.1, gloo) against 1 node
    x 2 processes: the same global ranks read the same samples, and gloo's all-reduce of two
    ranks adds the same two numbers, so the weights are the same bytes."""
    work, _ = mechanics_build
    out = tmp_path / "two_nodes"
    procs = multinode.train_localhost_nodes(work, out, nodes=2)
    codes = [p.wait(timeout=600) for p in procs]
    logs = [(out / f"node{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert sha256_file(out / "draft" / "model.safetensors") == one_node_draft
    assert "over 2 process(es) on cpu" in logs[0]
    assert "every process sees the same inputs" in logs[0]
    assert all("over 2 processes" in log for log in logs)  # the checksums shared out


def test_a_global_batch_the_prepared_samples_cannot_fill_is_refused_naming_the_keys():
    config = cfg(num_nodes=4, num_gpus=8, grad_accum_steps=2)  # 64 micro-batches a step
    assert checks.check_global_batch(config, None) == []  # before prepare has run
    assert checks.check_global_batch(config, 100) == []  # 95 training samples
    with pytest.raises(UserError) as exc:
        checks.check_global_batch(config, 60)
    for key in ("train.num_nodes 4", "train.num_gpus 8", "train.grad_accum_steps 2", "of 64"):
        assert key in str(exc.value), str(exc.value)
    (warning,) = checks.check_global_batch(config, 60, ["vocab_map"])
    assert "cannot fill one global batch" in warning


def test_a_micro_batch_budget_below_the_longest_sample_is_warned_of():
    config = load_config({"train": {"micro_batch_budget_tokens": 256}})
    (warning,) = [w for w in checks.warnings_for(config) if "micro_batch" in w]
    assert "train.micro_batch_budget_tokens 256 is below prepare.max_seq_len_tokens 2048" in warning
    assert not [w for w in checks.warnings_for(cfg()) if "micro_batch" in w]
