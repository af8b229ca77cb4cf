"""The job this workflow was first built for, config.kimi-k25-8x.yaml (Kimi-K2.5, INT4 experts,
one 8-GPU node, tensor parallel 8, float8 shards), dry-run against a stand-in of the verifier:
Kimi-K2.5's config layout (tests/data/kimi_k25_config.json: the multimodal wrapper, its
DeepSeek-V3-style text_config with MLA and yarn, compressed-tensors INT4 experts), its tokenizer
and image processor files (a tiktoken tokenizer shipped as code, a chat template), a weight index
over 64 shard files, no weights. The dry-run plans every stage in seconds; the layer ids and the
disk plan are the job's; what cannot work is refused, naming the key."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from tests.chat_families import FAMILIES
from tests.workflow_runner import dry_run_in_process, example_workflow, jobs_in, snakemake

pytestmark = pytest.mark.workflow

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config.kimi-k25-8x.yaml"
SHARDS = 64


def stand_in(path: Path) -> Path:
    """Kimi-K2.5's directory without its weights (empty shard files under their real names)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text((ROOT / "tests/data/kimi_k25_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [163585, 163586]}))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                "tokenizer_class": "TikTokenTokenizer",
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
            }
        )
    )
    (path / "chat_template.jinja").write_text(FAMILIES["kimi_k25"].template)
    (path / "preprocessor_config.json").write_text(
        (ROOT / "tests/data/kimi_k25_preprocessor_config.json").read_text()
    )
    (path / "tiktoken.model").write_bytes(b"")
    (path / "tokenization_kimi.py").write_text("# the tokenizer's code ships with the model\n")
    names = [f"model-{i:05d}-of-{SHARDS:06d}.safetensors" for i in range(1, SHARDS + 1)]
    weight_map = {
        "language_model.model.embed_tokens.weight": names[0],
        "language_model.model.norm.weight": names[-1],
        "language_model.lm_head.weight": names[-1],
        **{
            f"language_model.model.layers.{i}.self_attn.kv_b_proj.weight": names[i]
            for i in range(60)
        },
    }
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in names:
        (path / name).write_bytes(b"")
    return path


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """A workflow copy with the job's config pointing at the stand-in and a small chat set."""
    root = tmp_path_factory.mktemp("kimi")
    verifier = stand_in(root / "Kimi-K2.5")
    work, config = example_workflow(root, CONFIG, verifier)
    return work, config, verifier


def dry_run(work: Path, *args: str):
    start = time.monotonic()
    proc = snakemake(work, "-n", "draft_ckpt", "--resources", "gpu=8", *args, check=False)
    return proc, time.monotonic() - start


def test_the_job_plans_every_stage_in_seconds(kimi):
    work, _, _ = kimi
    proc, first = dry_run(work)  # the first asks vLLM's registry about the architecture
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert jobs_in(proc.stdout + proc.stderr) == {
        "data": 1,
        "regenerate": 1,
        "regenerate_merge": 1,
        "prepare": 1,
        "vocab": 1,
        "extract": 1,
        "extract_merge": 1,
        "train": 1,
    }
    proc, again = dry_run(work)
    assert proc.returncode == 0
    print(f"dry-run of config.kimi-k25-8x.yaml: {first:.1f} s, then {again:.1f} s")
    assert again < 60


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"extract": {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}},
            r"extract\.pipeline_parallel_size 2: vLLM's hidden-state extraction runs at pipeline",
        ),
        (
            {"train": {"num_gpus": 16}},
            r"train\.num_gpus is 16 GPUs, but snakemake --resources gpu=8",
        ),
        (
            {"extract": {"tensor_parallel_size": 16}},
            r"extract\.tensor_parallel_size is 16 GPUs, but snakemake --resources gpu=8",
        ),
        (
            {"chat_template": {"trust_remote_code": False}},
            r"set chat_template\.trust_remote_code: true",
        ),
        (
            {"extract": {"tensor_parallel_size": 3}},
            r"extract\.tensor_parallel_size 3 does not divide",
        ),
    ],
    ids=["pipeline", "train_gpus", "extract_gpus", "tokenizer_code", "heads"],
)
def test_what_cannot_work_is_refused_naming_the_key(kimi, change, expected):
    """In this process (the command line's own refusal, without a traceback, is
    tests/test_staleness.py's)."""
    work, config, _ = kimi
    changed = {**config, **{k: {**config.get(k, {}), **v} for k, v in change.items()}}
    error, out = dry_run_in_process(work, "draft_ckpt", changed, resources={"gpu": 8})
    assert error is not None and re.search(expected, error), (error, out[-3000:])


def test_the_layer_ids_and_the_disk_plan_for_1000_samples(kimi, tmp_path, monkeypatch):
    """The extraction job's plan before its model loads: layers [2, 30, 58] + the final 61, and
    the exact bytes of 1,000 samples of about 500 tokens (half of them supervised) in float8."""
    from workflow_scripts.lib.hidden_states.disk_plan import disk_plan
    from workflow_scripts.lib.hidden_states.extraction import make_plan
    from workflow_scripts.lib.workflow.config import load_config
    from workflow_scripts.lib.workflow.registry import ExtractIO

    _, config, verifier = kimi
    monkeypatch.chdir(tmp_path)
    g = torch.Generator().manual_seed(0)
    with open("tokenized.jsonl", "w") as fh:
        for i in range(1000):
            n = 450 + int(torch.randint(0, 100, (1,), generator=g))
            ids = torch.randint(0, 163840, (n,), generator=g).tolist()
            fh.write(
                json.dumps(
                    {"id": i, "input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)}
                )
                + "\n"
            )
    p = load_config(config).extract
    io = ExtractIO(
        tokenized="tokenized.jsonl",
        verifier=verifier,
        shard_dir="shards",
        job_index=0,
        part="part.json",
    )
    plan = make_plan(io, p)
    assert plan.aux_ids == [2, 30, 58] and plan.num_layers == 61 and plan.hidden_size == 7168
    assert plan.storage == "float8_e4m3fn" and plan.dtype == "bfloat16"
    dp = disk_plan(plan)
    tokens = dp["num_tokens"]
    fp8 = dp["by_storage_dtype"]["float8_e4m3fn"]["bytes"]
    per_token = fp8 / tokens
    # 3 aux rows of 7168 one-byte values and a scale each, a final row where the loss reads
    assert 3 * 7168 < per_token < 3 * 7168 + 7168 / 2 + 200, per_token
    assert fp8 / dp["by_storage_dtype"]["float32"]["bytes"] < 0.27
    print(f"disk plan: {tokens} tokens, {fp8 / 2**30:.2f} GiB in float8 ({per_token:.0f} B/token)")
