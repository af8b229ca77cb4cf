"""The verifier's engine over several nodes (<stage>.num_nodes): the settings, the checks at
dry-run, the nodes launcher's engine mode, the stage's engine as node 0 and the followers' node
ranks, and the worked example (config.deepseek-v3-2x8.yaml) dry-run against a stand-in of
DeepSeek-V3 (its config.json, a tokenizer, a weight index with the checkpoint's size, empty weight
files). Extraction over two nodes of a real SLURM, killed and resumed: tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.chat_families import FAMILIES
from tests.workflow_runner import dry_run_in_process, example_workflow, jobs_in
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier import cluster, engine, engine_follower, engine_nodes, preflight
from workflow_scripts.lib.workflow import checks, nodes
from workflow_scripts.lib.workflow.config import load_config
from workflow_scripts.lib.workflow.definitions import ExtractParams

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config.deepseek-v3-2x8.yaml"
CLUSTER = {"nodes": 2, "gpus_per_node": 8, "partition": "gpu"}
LAUNCHER_ENV = {
    engine_nodes.ENV_NODES: "2",
    engine_nodes.ENV_HOSTS: "n0,n1",
    engine_nodes.ENV_MASTER_ADDR: "127.0.0.1",
}


def two_nodes(**extract):
    return load_config(
        {"extract": {"num_nodes": 2, "tensor_parallel_size": 16, "use_gpus": True, **extract}}
    )


# ----------------------------------------------------------------- settings


def test_tensor_parallelism_is_shared_evenly_by_the_nodes_without_pipeline_stages():
    p = ExtractParams(num_nodes=2, tensor_parallel_size=16)
    assert (p.gpus, p.gpus_per_node) == (16, 8)
    assert ExtractParams(num_nodes=2, tensor_parallel_size=2, use_gpus=False).gpus_per_node == 0
    with pytest.raises(ValidationError, match="extract.tensor_parallel_size 3 over extract.num"):
        ExtractParams(num_nodes=2, tensor_parallel_size=3)
    with pytest.raises(ValidationError, match="by tensor parallelism only"):
        ExtractParams(num_nodes=2, tensor_parallel_size=8, pipeline_parallel_size=2)
    # what an engine over nodes changes is how it runs, not what it makes
    assert "num_nodes" in ExtractParams.EXECUTION
    assert "num_nodes" not in ExtractParams(num_nodes=2, tensor_parallel_size=2).result_settings()


# ----------------------------------------------------------------- checked at dry-run


def test_engine_nodes_against_the_profile_and_the_cluster():
    cfg = two_nodes()
    assert cluster.check_node_counts(cfg, {}, CLUSTER) == []
    assert cluster.spans_nodes(cfg) and not cluster.spans_nodes(load_config({}))
    refused = {
        "extract.num_nodes is 2, but the profile sets nodes: 1 for rule extract": (
            {"extract": {"nodes": 1}},
            CLUSTER,
            cfg,
        ),
        "extract.num_nodes is 3, but SLURM has 2 node(s) in partition gpu; lower extract.num_nodes": (
            {},
            CLUSTER,
            two_nodes(num_nodes=3, tensor_parallel_size=12),
        ),
        "extract.tensor_parallel_size / extract.num_nodes is 8 GPUs on each of extract.num_nodes "
        "2 nodes, but SLURM's nodes in partition gpu have at most 4": (
            {},
            {**CLUSTER, "gpus_per_node": 4},
            cfg,
        ),
        "evaluate.num_nodes is 2, but the profile sets tasks: 1 for rule evaluate_draft": (
            {"evaluate_draft": {"tasks": 1}},
            CLUSTER,
            load_config({"evaluate": {"num_nodes": 2, "tensor_parallel_size": 2}}),
        ),
        "extract.num_nodes is 2 with extract.disk_budget": (
            {},
            CLUSTER,
            two_nodes(disk_budget="1TB"),
        ),
        "extract.num_nodes is 2 with extract.backend transformers": (
            {},
            CLUSTER,
            two_nodes(backend="transformers"),
        ),
    }
    for why, (overrides, where, config) in refused.items():
        with pytest.raises(UserError) as exc:
            cluster.check_node_counts(config, overrides, where)
        assert why in str(exc.value), str(exc.value)
    # no SLURM here: a warning only; a target that needs no extraction: a warning
    (warning,) = cluster.check_node_counts(cfg, {}, None)
    assert "extract.num_nodes is 2" in warning and "SLURM cannot be reached here" in warning
    (warning,) = cluster.check_node_counts(cfg, {"extract": {"nodes": 1}}, CLUSTER, ["vocab_map"])
    assert "the profile sets nodes: 1 for rule extract" in warning


def test_gpu_counts_of_an_engine_over_nodes_are_its_total_and_its_share_of_a_node():
    config = load_config(
        {"extract": {"num_nodes": 2, "tensor_parallel_size": 16}, "gpus_per_node": 8}
    )
    assert checks.check_gpu_counts(config, 16) == []
    with pytest.raises(UserError, match="extract.tensor_parallel_size is 16 GPUs, but snakemake"):
        checks.check_gpu_counts(config, 8)
    wide = load_config(
        {"extract": {"num_nodes": 2, "tensor_parallel_size": 32}, "gpus_per_node": 8}
    )
    with pytest.raises(UserError) as exc:
        checks.check_gpu_counts(wide, 64)
    assert (
        "extract.tensor_parallel_size / extract.num_nodes is 16 GPUs, but a node has 8 "
        "(gpus_per_node) and that many run on each node; lower extract.tensor_parallel_size, or "
        "raise extract.num_nodes"
    ) in str(exc.value)


def test_extraction_with_pipeline_stages_is_refused_with_the_reason():
    p = ExtractParams(tensor_parallel_size=2, pipeline_parallel_size=2)
    cfg = {"num_hidden_layers": 8, "num_attention_heads": 4, "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(UserError, match="connector expects its cache layer on every rank"):
        preflight.check_extract(p, cfg, in_job=False)


# ----------------------------------------------------------------- the launcher and the nodes


def test_the_launcher_names_the_engine_key_outside_slurm_and_starts_followers_on_the_others():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cmd = [sys.executable, "-m", "workflow_scripts.lib.workflow.nodes", "2", "--key"]
    cmd += ["evaluate.num_nodes", "--engine", "results/nodes", "--gpus", "8", "--", "echo", "ran"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "ran" not in proc.stdout
    assert "evaluate.num_nodes is 2: the evaluate job over several nodes runs inside a SLURM" in (
        proc.stderr
    )
    srun = nodes.follower_command(3, 8)
    assert srun[:6] == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--relative=1",
        "--kill-on-bad-exit=1",
    ]  # fmt: skip
    assert srun[-4:] == [
        "--",
        sys.executable,
        "-m",
        "workflow_scripts.lib.verifier.engine_follower",
    ]
    assert "workflow_scripts.lib.workflow.gpus" in srun and "8" in srun
    assert "workflow_scripts.lib.workflow.gpus" not in nodes.follower_command(2, 0)


def test_the_stage_engine_is_node_0_only_under_the_launcher(tmp_path):
    p = ExtractParams(num_nodes=2, tensor_parallel_size=2, use_gpus=False)
    with pytest.raises(UserError, match="extract.num_nodes is 2: the verifier's engine spans 2"):
        engine_nodes.driver_args(p, {})
    with pytest.raises(UserError, match=r"it started one for 3 nodes"):
        engine_nodes.driver_args(p, {**LAUNCHER_ENV, engine_nodes.ENV_NODES: "3"})
    assert engine_nodes.driver_args(ExtractParams(), {}) == {}
    assert engine_nodes.driver_args(p, LAUNCHER_ENV) == {
        "nnodes": 2,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "distributed_executor_backend": "mp",
    }
    # published with a port free on node 0 and a new id; withdrawn when the engine closes
    env = {**LAUNCHER_ENV, engine_nodes.ENV_ARGS: str(tmp_path / "meet" / "job-1.json")}
    kwargs = {"model": "m", "tensor_parallel_size": 2, **engine_nodes.driver_args(p, env)}
    first = engine_nodes.publish(kwargs, env)
    published = engine_nodes.read_published(Path(env[engine_nodes.ENV_ARGS]))
    assert published["id"] == first and published["kwargs"]["master_port"] > 0
    assert published["kwargs"] == kwargs
    engine_nodes.withdraw(env)
    assert not Path(env[engine_nodes.ENV_ARGS]).exists()


def test_a_follower_takes_its_node_rank_from_its_place_in_the_job():
    env = {**LAUNCHER_ENV, engine_nodes.ENV_HOSTS: "a,b,c"}
    assert engine_follower.node_rank({**env, "SLURMD_NODENAME": "c"}) == 2
    for name in ("a", "z"):  # the first node runs the stage; z is no node of the job
        with pytest.raises(UserError, match="not one of the engine's other nodes"):
            engine_follower.node_rank({**env, "SLURMD_NODENAME": name})


# ----------------------------------------------------------------- the worked example

DEEPSEEK_V3 = {  # DeepSeek-V3's config.json
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 1,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}
SIZE = 688_586_727_753  # bytes: its weight index's total_size
SHARDS = 163


def stand_in(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": FAMILIES["deepseek_r1"].template})
    )
    names = [f"model-{i:05d}-of-{SHARDS:06d}.safetensors" for i in range(1, SHARDS + 1)]
    weight_map = {"model.embed_tokens.weight": names[0], "lm_head.weight": names[-1]}
    index = {"metadata": {"total_size": SIZE}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in names:
        (path / name).write_bytes(b"")
    return path


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return example_workflow(root, EXAMPLE, stand_in(root / "DeepSeek-V3"))


@pytest.mark.workflow
def test_the_example_plans_engines_over_two_nodes(deepseek):
    work, config = deepseek
    error, out = dry_run_in_process(
        work, "evaluate", config, printshellcmds=True, resources={"gpu": 16}
    )
    assert error is None, out[-3000:]
    assert jobs_in(out) == {
        "data": 1, "regenerate": 1, "regenerate_merge": 1, "prepare": 1, "vocab": 1,
        "extract": 2, "extract_merge": 1, "train": 1, "evaluate_reference": 1,
        "evaluate_draft": 1, "resolved_config": 1,
    }  # fmt: skip
    assert "resources: tmpdir=/tmp, nodes=2, tasks=2, mpi=srun, gres=gpu:8, gpu=16" in out
    engines = [line for line in out.splitlines() if "workflow_scripts.lib.workflow.nodes 2" in line]
    assert len(engines) == 5  # regenerate, the two extract jobs, evaluate's two
    for stage in ("regenerate", "extract", "evaluate"):
        assert any(f"--key {stage}.num_nodes --engine results-deepseek-v3/nodes --gpus 8 --" in line
                   for line in engines), stage  # fmt: skip
    assert "workflow_scripts.lib.workflow.gpus 8 --" in engines[0]


@pytest.mark.workflow
@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"extract": {"tensor_parallel_size": 32}},
            "extract.tensor_parallel_size / extract.num_nodes is 16 GPUs, but a node has 8",
        ),
        (
            {"gpu_memory_bytes": "40GB"},
            "the verifier's weights (688.6 GB) on extract.tensor_parallel_size 16 GPU(s), 43.0 GB "
            "a GPU, exceed extract.gpu_memory_utilization 0.9 of one GPU's 40.0 GB "
            "(gpu_memory_bytes), 36.0 GB; raise extract.tensor_parallel_size to 32 over "
            "extract.num_nodes 4",
        ),
        (
            {"evaluate": {"num_nodes": 3}},
            "evaluate.tensor_parallel_size 16 over evaluate.num_nodes 3",
        ),
    ],
)
def test_the_example_refuses_what_cannot_run_naming_the_key(deepseek, change, expected):
    work, config = deepseek
    changed = {k: {**config[k], **v} if isinstance(v, dict) else v for k, v in change.items()}
    error, out = dry_run_in_process(work, "evaluate", {**config, **changed})
    assert error is not None and expected in error, (error, out[-3000:])


def test_each_job_checks_the_gpus_of_its_own_node(monkeypatch):
    """Before its model loads, an engine over nodes wants its share of GPUs on this node."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    p = ExtractParams(num_nodes=2, tensor_parallel_size=16)
    with pytest.raises(UserError, match="tensor_parallel_size 16 over extract.num_nodes 2 is 8 a"):
        engine.check_devices(p, "extract", vllm=False)
