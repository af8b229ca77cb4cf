"""The recipe, measured: drafts of each variant, 3 training seeds each, on the quality benchmark
(config.quality.yaml: the verifier's own greedy answers, several hundred held-out prompts),
scored by vLLM (greedy; mean acceptance length, per position), each variant against today's
recipe as a paired difference over the same prompts with a bootstrap interval.

    .venv/bin/python benchmarks/bench_quality.py                      # DEFAULT's, 3 seeds
    .venv/bin/python benchmarks/bench_quality.py --only baseline lk_hybrid
    .venv/bin/python benchmarks/bench_quality.py --lanes 2            # 2 runs at once
    .venv/bin/python benchmarks/bench_quality.py --table              # the table of what is done
    .venv/bin/python benchmarks/bench_quality.py --bench long         # long contexts (below)
    .venv/bin/python benchmarks/bench_quality.py --bench real         # a real pretrained verifier

Runs share one Snakemake working directory (--workdir), one after the other, as a user would
change the config: the workflow reruns exactly what a run changes (a train setting: train and
evaluate), and reuses the rest (the verifier, the regenerated answers, the shards); a variant of
the chat data itself (the corpus's size, CORPUS_SECTIONS) builds it in <workdir>.<variant>. With
--lanes N, N runs go at once, each with its share of --cores, in N working directories: the
first, then N - 1 copies of it (<workdir>.lane1, ...) made once its first run has built the
stages they share. Each run's evaluation and training metrics are kept under
<workdir>/bench/<variant>@<seed>/, and what the table needs of it is kept in the repository,
benchmarks/results/quality/<variant>@<seed>.json (--kept), with the fingerprints of the code of
the stages that compute from the chat data (RUN_STAGES) and the sha256 of the verifier and chat
data it was computed from: a run kept by the same code from the same build is not run again, so
an interrupted benchmark goes on where it stopped, in this working directory or in a fresh clone
(whose build gives the same bytes on a CPU of the same kind, see docs/evaluation-and-quality.md).
A run kept by other code or from another build is run again (delete its file to redo any run).
The table says how long the runs took.

The table (also written to <workdir>/bench/table.md and to the kept runs' table.md), per variant
over its seeds: the mean acceptance length and its range over the seeds (the run-to-run noise of
training), the mean per position, training's simulated acceptance length, n-gram's, and against
the baseline the paired difference: the acceptance length of all of the variant's runs pooled
minus the baseline's, on the same prompts, with a 95% bootstrap interval over prompts (prompts
resampled with replacement, the same for both). A variant is better beyond noise when that
interval is above 0 and the difference is larger than both seed ranges.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.workflow_run import snakemake, stage_seconds  # noqa: E402
from workflow_scripts.lib.workflow.config import layered_files  # noqa: E402
from workflow_scripts.lib.evaluation.acceptance import tokens_per_pass  # noqa: E402
from workflow_scripts.lib.workflow.layout import METRICS, RESULTS, Layout  # noqa: E402

KEPT = ROOT / "benchmarks" / "results" / "quality"
SEEDS = (0, 1, 2)
# A kept run counts for this checkout when the code of the stages that compute from the chat
# data is this checkout's (compared by fingerprint), and the chat data and verifier it was
# computed from (the demo and data stages' outputs) are this build's (compared by their bytes,
# once the build is made: the demo's code may change without changing the quality build).
RUN_STAGES = (
    "regenerate", "regenerate_merge", "prepare", "vocab", "extract", "extract_merge", "train",
    "evaluate_reference", "evaluate",
)  # fmt: skip
BUILT = {"verifier": "demo/verifier/model.safetensors", "chat_data": "data/chat_data.jsonl"}
# A variant with settings of these sections changes the chat data every other run computes from
# (the corpus's size): it runs in a working directory of its own, <workdir>.<variant>, built from
# scratch, and is held to the shared build's verifier and evaluation prompts only (its chat data
# is its own by design; the demo's held-out prompts do not depend on the corpus's size).
CORPUS_SECTIONS = ("demo", "data", "regenerate")
RESAMPLES = 2000
# a prompt's text repeats where n-gram found a match to draft from at this share of its verifier
# passes or more (the real verifier's greedy text: 34 of its 80 held-out prompts)
REPEATS = 0.5

# The speculators 0.9 EAGLE-3 defaults, as settings of this workflow: Muon on the weight matrices
# (lr 1e-3, momentum 0.95, weight decay 0.1), AdamW (lr 1e-4, weight decay 0.01) on the rest; a
# linear schedule with 1% warm-up, down to 0; norm_before_fc and norm_output; the lm_head frozen at
# the verifier's rows; the final norm started at ones; 8,192 tokens per micro-batch (its packed
# rows); the checkpoint with the lowest validation loss. Its 20 epochs are not copied: every
# variant trains as many steps' worth of data as the baseline (the epochs variant is the length).
SPECULATORS = {
    "optimizer": "muon",
    "muon_learning_rate": 1e-3,
    "muon_momentum": 0.95,
    "muon_weight_decay": 0.1,
    "learning_rate": 1e-4,
    "weight_decay": 0.01,
    "lr_schedule": "linear",
    "min_lr_ratio": 0.0,
    "warmup_steps": 4,  # 1% of its about 410 steps (the baseline's 4 epochs at 8,192 tokens)
    "norm_before_fc": True,
    "norm_output": True,
    "freeze_lm_head": True,
    "final_norm_init": "ones",
    "micro_batch_budget_tokens": 8192,
    "select_by": "validation_loss",
}

# name -> (what it changes, the settings it changes by config section); in the order they run.
# A train setting reruns train and evaluate; a storage dtype extract too (and the next run again).
VARIANTS: dict[str, tuple[str, dict]] = {
    "baseline": ("today's recipe (the benchmark's config file as it is)", {}),
    "lk_hybrid": ("train.loss: lk_hybrid (LK losses, eta 3)", {"train": {"loss": "lk_hybrid"}}),
    "tv": ("train.loss: tv (total variation)", {"train": {"loss": "tv"}}),
    "fc_norm": (
        "train.fc_norm: true (vLLM's EAGLE-3.1 per-layer norms)",
        {"train": {"fc_norm": True}},
    ),
    "epochs_2x": ("train.epochs: 8 (the same data twice as long)", {"train": {"epochs": 8}}),
    "speculators": ("speculators 0.9's EAGLE-3 recipe (see SPECULATORS)", {"train": SPECULATORS}),
    "muon": (
        "train.optimizer: muon (lr 1e-3) with AdamW on the rest",
        {"train": {"optimizer": "muon"}},
    ),
    "frozen_lm_head": ("train.freeze_lm_head: true", {"train": {"freeze_lm_head": True}}),
    "eagle3.1_norms": (
        "train.norm_before_fc and train.norm_output: true",
        {"train": {"norm_before_fc": True, "norm_output": True}},
    ),
    "speculators_equal_steps": (
        "speculators 0.9's recipe at the baseline's steps: 1,024-token micro-batches",
        {"train": {**SPECULATORS, "micro_batch_budget_tokens": 1024, "warmup_steps": 30}},
    ),
    "accepted_chain": (
        "train.ttt_positions: accepted_chain (GRIFFIN's token alignment)",
        {"train": {"ttt_positions": "accepted_chain"}},
    ),
    "topk_loss": (
        "train.topk_loss_weight: 1 (HASS's top-K distillation, K 10)",
        {"train": {"topk_loss_weight": 1.0}},
    ),
    "step_decay": (
        "train.ttt_step_loss_decay: 0.8 (EAGLE's per-step weights)",
        {"train": {"ttt_step_loss_decay": 0.8}},
    ),
    "ttt_5": ("train.ttt_steps: 5 (deeper than the served k = 3)", {"train": {"ttt_steps": 5}}),
    "layers_2": ("train.num_draft_layers: 2", {"train": {"num_draft_layers": 2}}),
    "layers_3": ("train.num_draft_layers: 3", {"train": {"num_draft_layers": 3}}),
    "muon_matched": (
        "train.optimizer: muon at the baseline's learning rate (3e-3) with AdamW on the rest",
        {"train": {"optimizer": "muon", "muon_learning_rate": 3e-3}},
    ),
    "aux_noise": (
        "train.aux_noise: 0.3 (uniform noise, about 6% of the states' RMS)",
        {"train": {"aux_noise": 0.3}},
    ),
    "regenerate_sampled": (
        "regenerate.temperature: 1 (the verifier's sampled answers, not its greedy ones)",
        {"regenerate": {"temperature": 1.0}},
    ),
    "qwen3_layer": (
        "train.draft_layer: qwen3 (a query and key norm per head)",
        {"train": {"draft_layer": "qwen3"}},
    ),
    "aux_layers_high": (
        "extract.aux_layer_ids: [2, 4, 7] (the last layer's input, not N - 3's)",
        {"extract": {"aux_layer_ids": [2, 4, 7]}},
    ),
    "aux_layers_deep": (
        "extract.aux_layer_ids: [3, 5, 7] (each a layer deeper or more)",
        {"extract": {"aux_layer_ids": [3, 5, 7]}},
    ),
    "aux_layers_last": (
        "extract.aux_layer_ids: [5, 6, 7] (the last three layers' inputs)",
        {"extract": {"aux_layer_ids": [5, 6, 7]}},
    ),
    "storage_bfloat16": (
        "extract.storage_dtype: bfloat16",
        {"extract": {"storage_dtype": "bfloat16"}},
    ),
    "storage_float8": (
        "extract.storage_dtype: float8_e4m3fn",
        {"extract": {"storage_dtype": "float8_e4m3fn"}},
    ),
    "warm_start": (
        "train.init_from: the draft trained on other data (SOURCES' human_answers), then the "
        "baseline's steps on this data",
        {"train": {"init_from": "source:human_answers"}},
    ),
    # the long-context benchmark's (--bench long): its baseline trains on samples cut at 512
    "long_samples": (
        "prepare.max_seq_len_tokens: 4095 (whole conversations, not cut at 512 tokens)",
        {"prepare": {"max_seq_len_tokens": 4095}},
    ),
    "window": (
        "train.sliding_window_tokens: 512 (the draft attends to the 512 latest tokens)",
        {"train": {"sliding_window_tokens": 512}},
    ),
    "long_window": (
        "whole conversations and a 512-token sliding window",
        {"prepare": {"max_seq_len_tokens": 4095}, "train": {"sliding_window_tokens": 512}},
    ),
    # the real-model benchmark's (--bench real): SmolLM2-135M-Instruct, 30 layers, vocabulary
    # 49,152; its baseline: auxiliary layers [2, 15, 27], draft vocabulary 8,192, whole
    # conversations, full attention
    "real_speculators_equal_steps": (
        "speculators 0.9's recipe at the baseline's steps and micro-batches",
        {"train": {**SPECULATORS, "micro_batch_budget_tokens": 4096, "warmup_steps": 2}},
    ),
    "real_residual_false": (
        "train.norm_before_residual: false (the residual convention SGLang and TensorRT-LLM serve)",
        {"train": {"norm_before_residual": False}},
    ),
    "real_fc_norm": (
        "train.fc_norm and train.norm_output: true (vLLM's EAGLE-3.1 norms, the per-layer form)",
        {"train": {"fc_norm": True, "norm_output": True}},
    ),
    "real_aux_high": (
        "extract.aux_layer_ids: [2, 15, 29] (the last layer's input, not N - 3's)",
        {"extract": {"aux_layer_ids": [2, 15, 29]}},
    ),
    "real_aux_deep": (
        "extract.aux_layer_ids: [8, 20, 29] (each a third of the way deeper)",
        {"extract": {"aux_layer_ids": [8, 20, 29]}},
    ),
    "real_aux_last": (
        "extract.aux_layer_ids: [27, 28, 29] (the last three layers' inputs)",
        {"extract": {"aux_layer_ids": [27, 28, 29]}},
    ),
    "vocab_4k": ("vocab.draft_vocab_size: 4096", {"vocab": {"draft_vocab_size": 4096}}),
    "vocab_16k": ("vocab.draft_vocab_size: 16384", {"vocab": {"draft_vocab_size": 16384}}),
    "vocab_32k": ("vocab.draft_vocab_size: 32768", {"vocab": {"draft_vocab_size": 32768}}),
    "vocab_full": (
        "vocab.draft_vocab_size: 49152 (the verifier's whole vocabulary)",
        {"vocab": {"draft_vocab_size": 49152}},
    ),
    "real_samples_512": (
        "prepare.max_seq_len_tokens: 512 (samples cut short, not whole conversations)",
        {"prepare": {"max_seq_len_tokens": 512}},
    ),
    "real_epochs_10": (
        "train.epochs: 10 (config.yaml's own length, five times the benchmark's 2)",
        {"train": {"epochs": 10}},
    ),
    "real_window": (
        "train.sliding_window_tokens: 512 (the draft attends to the 512 latest tokens)",
        {"train": {"sliding_window_tokens": 512}},
    ),
    # levers on a draft trained as long as config.yaml's recipe trains (10 epochs), each held
    # to real_epochs_10 (AGAINST), not to the 2-epoch baseline
    "real10_speculators_equal_steps": (
        "speculators 0.9's recipe at real_epochs_10's steps and micro-batches",
        {"train": {**SPECULATORS, "micro_batch_budget_tokens": 4096, "warmup_steps": 8,
                   "epochs": 10}},
    ),  # fmt: skip
    "real10_eagle3.1_norms": (
        "train.norm_before_fc and train.norm_output: true, 10 epochs",
        {"train": {"norm_before_fc": True, "norm_output": True, "epochs": 10}},
    ),
    "real_corpus_4000": (
        "demo.num_conversations: 4000 (four times the corpus, the first 1,000 among them: 4x the "
        "steps at 2 epochs, near real_epochs_10's 5x over 1,000)",
        {"demo": {"num_conversations": 4000}},
    ),
    "real_corpus_all": (
        "demo.num_conversations: 10729 (the whole training corpus, 2.7x real_corpus_4000's: about "
        "11 hours of build on 2 cores; run with --only)",
        {"demo": {"num_conversations": 10729}},
    ),
}
# the variant a variant is paired against where it is not the baseline (the same length)
AGAINST = {
    "real10_speculators_equal_steps": "real_epochs_10",
    "real10_eagle3.1_norms": "real_epochs_10",
}
# The drafts a variant starts from (train.init_from: "source:<name>"): trained once in a run's
# working directory with these settings (and seed 0) over the quality build, as a user would
# train a draft on other data, then copied out of results_dir (training rewrites it) to
# <workdir>/bench/sources/<name>/draft.
SOURCES: dict[str, tuple[str, dict]] = {
    "human_answers": (
        "the packages' own text as the answers (regenerate.enabled: false), not the verifier's",
        {"regenerate": {"enabled": False}},
    ),
}
SOURCE = "source:"
# what a plain run measures: the methods at the baseline's steps and tokens per step, and the
# reference recipe at those steps and at its own micro-batches (the rest with --only)
DEFAULT = (
    "baseline",
    "qwen3_layer",
    "aux_layers_high",
    "aux_layers_deep",
    "aux_layers_last",
    "speculators_equal_steps",
    "speculators",
    "layers_2",
    "layers_3",
    "topk_loss",
    "ttt_5",
    "step_decay",
    "accepted_chain",
    "warm_start",
)
# the real-model benchmark's plain run: the levers the field measured on real models; the
# variants that change prepare's or extract's output (samples cut short, auxiliary layers) last,
# as each redoes extraction, and after them the corpus four times as large (its own build: about
# 4 hours on 2 cores beside another run, regeneration 40% of it; its seeds share it)
REAL = (
    "baseline",
    "real_speculators_equal_steps",
    "eagle3.1_norms",
    "real_residual_false",
    "real_fc_norm",
    "vocab_4k",
    "vocab_16k",
    "vocab_32k",
    "vocab_full",
    "layers_2",
    "qwen3_layer",
    "ttt_5",
    "topk_loss",
    "lk_hybrid",
    "accepted_chain",
    "real_window",
    "real_aux_high",
    "real_aux_deep",
    "real_aux_last",
    "real_samples_512",
    "real_corpus_4000",
)
# the benchmarks: name -> (config file, where runs are kept, the variants a plain run measures)
BENCHES = {
    "quality": (ROOT / "config.quality.yaml", KEPT, DEFAULT),
    "long": (
        ROOT / "config.long.yaml",
        KEPT.with_name("long"),
        ("baseline", "long_samples", "window", "long_window"),
    ),
    "real": (ROOT / "config.real.yaml", KEPT.with_name("real"), REAL),
}


def run_name(variant: str, seed: int) -> str:
    return f"{variant}@{seed}"


def build_of(results_dir: Path) -> dict[str, str]:
    """The sha256 of the shared build's outputs that every run computes from (BUILT)."""
    from workflow_scripts.lib.common import sha256_file

    return {name: sha256_file(results_dir / rel) for name, rel in BUILT.items()}


def results_dir_of(workdir: Path, configfile: Path) -> Path:
    return workdir / layered_files([ROOT / "config.yaml", configfile])["results_dir"]


def own_corpus(variant: str) -> bool:
    """Whether the variant makes chat data of its own (CORPUS_SECTIONS)."""
    return any(section in VARIANTS[variant][1] for section in CORPUS_SECTIONS)


def held_to(variant: str, build: dict[str, str]) -> dict[str, str]:
    """What of a build a variant's runs must share with the others': all of it, or for a variant
    with a corpus of its own everything but the chat data."""
    return {k: v for k, v in build.items() if k != "chat_data"} if own_corpus(variant) else build


def code_now() -> dict[str, str]:
    """The fingerprint of the code of each stage a run runs, as this checkout has it."""
    from workflow_scripts.lib.workflow.code_inputs import stage_fingerprint

    return {stage: stage_fingerprint(stage) for stage in RUN_STAGES}


def record(results: dict, **facts) -> dict:
    """What the table needs of a run's results.json (its prompts' acceptance histograms, not
    their texts), with ``facts`` about the run."""
    eagle3, ngram = results["runs"]["eagle3"], results["runs"]["ngram"]
    kept = {
        "summary": results["summary"],
        "made_by": results["made_by"],
        **{k: results[k] for k in ("num_prompts", "max_new_tokens", "num_speculative_tokens")},
        "runs": {
            "eagle3": {
                k: eagle3[k] for k in ("acceptance_rate_per_position", "acceptance_histograms",
                                       "acceptance_histograms_by_context")
            },
            "ngram": {
                "per_prompt": {"mean_acceptance_length_ci95": ngram["per_prompt"][
                    "mean_acceptance_length_ci95"]},
                "acceptance_histograms": ngram["acceptance_histograms"],
                "acceptance_histograms_by_context": ngram["acceptance_histograms_by_context"],
            },
        },
        "context_edges_tokens": results["context_edges_tokens"],
        # each set's prompts, in order (the histograms' rows, set after set)
        "sets": {name: {"num_prompts": e["num_prompts"]} for name, e in results["sets"].items()},
    }  # fmt: skip
    return {**facts, "results": kept}


def snakemake_run(
    workdir: Path, configfile: Path, override: Path, target: str, cores: str, lanes: int, name: str
) -> None:
    """``snakemake target`` in ``workdir`` over config.yaml, ``configfile`` and ``override``."""
    env = {}
    if lanes > 1:  # runs share the cores: OpenMP's threads sleep at barriers instead of spinning
        env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")  # (timing only)
    snakemake(workdir, [configfile, override], target, cores=cores, name=name, env=env)


SOURCE_LOCK = threading.Lock()
CORPUS_LOCK = threading.Lock()  # the runs of a corpus of its own: one at a time, in its directory


def source_draft(
    workdir: Path, bench: Path, configfile: Path, source: str, cores: str, lanes: int
) -> Path:
    """The draft of SOURCES[source], trained in ``workdir`` first if it is not there yet."""
    if source not in SOURCES:
        sys.exit(f"train.init_from {SOURCE}{source}: no such source (SOURCES: {list(SOURCES)})")
    draft = bench / "sources" / source / "draft"
    with SOURCE_LOCK:  # one lane trains it; another waits for it
        if not (draft / "model.safetensors").is_file():
            override = bench / "sources" / f"{source}.yaml"
            override.parent.mkdir(parents=True, exist_ok=True)
            settings = dict(SOURCES[source][1])
            settings["train"] = {**settings.get("train", {}), "seed": 0}
            override.write_text(yaml.safe_dump(settings))
            snakemake_run(workdir, configfile, override, "draft_ckpt", cores, lanes, source)
            tmp = draft.with_name(".draft.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(results_dir_of(workdir, configfile) / "train" / "draft", tmp)
            tmp.rename(draft)
    return draft


def run_once(
    workdir: Path,
    bench: Path,
    kept: Path,
    code: dict,
    configfile: Path,
    variant: str,
    seed: int,
    cores: str,
    lanes: int,
) -> Path:
    """The workflow's evaluate target in ``workdir`` with the variant's settings and seed; keeps
    its outputs under ``bench`` and its record in ``kept``. ``lanes``: how many runs go at once
    (for the time per run)."""
    import torch

    name = run_name(variant, seed)
    shared_results = results_dir_of(workdir, configfile)
    if own_corpus(variant):  # its own working directory: its chat data is not the others'
        if not Layout(shared_results).demo.eval_prompts.is_file():
            sys.exit(
                f"[{name}] builds a corpus of its own, evaluated on the shared build's prompts: "
                "make the shared build first (--only baseline)"
            )
        workdir = bench.parent.with_name(f"{bench.parent.name}.{variant}")
        workdir.mkdir(exist_ok=True)
    out = bench / name
    override = bench / f"{name}.yaml"
    override.parent.mkdir(parents=True, exist_ok=True)
    declared = dict(VARIANTS[variant][1])  # as recorded: a source by its name, not its path
    declared["train"] = {**declared.get("train", {}), "seed": seed}
    settings = {**declared, "train": dict(declared["train"])}
    init_from = settings["train"].get("init_from") or ""
    if init_from.startswith(SOURCE):  # the source's draft, trained first where it is not yet
        draft = source_draft(workdir, bench, configfile, init_from[len(SOURCE) :], cores, lanes)
        settings["train"]["init_from"] = str(draft)
    override.write_text(yaml.safe_dump(settings))
    results_dir = results_dir_of(workdir, configfile)
    # the run's evaluation is made afresh: a run stopped during training leaves the last run's
    # results.json, which Snakemake would take as this run's without training its draft
    (Layout(results_dir).evaluate.results).unlink(missing_ok=True)
    start = time.monotonic()
    snakemake_run(workdir, configfile, override, "evaluate", cores, lanes, name)
    prompts = [Layout(d).demo.eval_prompts for d in (shared_results, results_dir)]
    if own_corpus(variant) and prompts[0].read_bytes() != prompts[1].read_bytes():
        sys.exit(f"[{name}] evaluated on other prompts than the shared build's: {prompts}")
    tmp = out.with_name(f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(Layout(results_dir).evaluate.results, tmp / RESULTS)
    shutil.copy(Layout(results_dir).train.metrics, tmp / METRICS)
    (tmp / "wall_s").write_text(f"{time.monotonic() - start:.0f}\n")
    # what a run of a train setting costs (the first run's wall time includes the stages before)
    stages_s = sum(stage_seconds(results_dir, rule) for rule in ("train", "evaluate"))
    (tmp / "train_evaluate_s").write_text(f"{stages_s:.0f}\n")
    (tmp / "lanes").write_text(f"{lanes}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    facts = {
        "variant": variant,
        "seed": seed,
        "settings": declared,
        "code": code,
        "build": build_of(results_dir),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "wall_s": round(time.monotonic() - start),
        "train_evaluate_s": round(stages_s),
        "lanes": lanes,
        "share": machine_share(cores),
    }
    kept.mkdir(parents=True, exist_ok=True)
    path = kept / f"{name}.json"
    results = json.loads((out / RESULTS).read_text())
    path.with_suffix(".tmp").write_text(json.dumps(record(results, **facts), indent=1) + "\n")
    path.with_suffix(".tmp").rename(path)
    print(f"[{name}] done in {time.monotonic() - start:.0f}s", flush=True)
    return out


def run_all(
    workdir: Path,
    kept: Path,
    code: dict,
    configfile: Path,
    todo: list[tuple[str, int]],
    cores: str,
    lanes: int,
):
    """The runs ``todo`` in order, ``lanes`` at a time; the first alone in ``workdir`` when no
    run was done there yet (it builds the stages every run shares), then the copies."""
    bench = workdir / "bench"
    if todo and not any(bench.glob(f"*@*/{RESULTS}")):
        run_once(workdir, bench, kept, code, configfile, *todo.pop(0), cores, 1)
    if not todo:
        return
    dirs = [workdir]
    for i in range(1, lanes):
        lane = workdir.with_name(f"{workdir.name}.lane{i}")
        if not lane.exists():  # the built stages, their mtimes and Snakemake's records kept
            print(f"copying {workdir} to {lane}", flush=True)
            shutil.copytree(workdir, lane, symlinks=True, ignore=shutil.ignore_patterns("bench"))
        dirs.append(lane)
    total = (os.cpu_count() or 1) if cores == "all" else int(cores)
    share = cores if lanes == 1 else str(max(1, total // lanes))
    free, lock, failed = list(dirs), threading.Lock(), threading.Event()

    def one(run: tuple[str, int]) -> Path | None:
        if failed.is_set():  # a run failed: the runs under way end, no other starts
            return None
        with lock:
            lane = free.pop()
        try:
            with CORPUS_LOCK if own_corpus(run[0]) else contextlib.nullcontext():
                return run_once(lane, bench, kept, code, configfile, *run, share, lanes)
        except BaseException:
            failed.set()
            raise
        finally:
            with lock:
                free.append(lane)

    with ThreadPoolExecutor(lanes) as pool:
        for run in [pool.submit(one, run) for run in todo]:
            run.result()  # the first failed run's error stops the benchmark


def machine_share(cores: str) -> float:
    """The part of this machine's cores a run was given (``--cores`` or its lane's share): its
    times count that part in the table's time per run. A run on 1 of 2 cores beside another
    takes about twice as long as alone, as does each of 2 lanes."""
    machine = os.cpu_count() or 1
    return round(min(1.0, (machine if cores == "all" else int(cores)) / machine), 3)


def time_share(run: dict) -> float:
    """The part of the machine a kept run had: its ``share``, or for records that predate it
    1 / its lanes (a run given fewer cores than the machine's without lanes counted whole)."""
    return run.get("share", 1 / run["lanes"])


def histograms(results: dict, run: str = "eagle3") -> np.ndarray:
    """[prompts, k + 1] vLLM's per-prompt acceptance histograms (verify steps that accepted 0..k
    draft tokens), in the prompts' order."""
    return np.array(
        [
            h or [0] * (results["num_speculative_tokens"] + 1)
            for h in results["runs"][run]["acceptance_histograms"]
        ],
        dtype=np.float64,
    )


def pooled_length(hists: list[np.ndarray], pick: np.ndarray | slice = slice(None)) -> np.ndarray:
    """Mean acceptance length pooled over runs and the prompts ``pick`` ([R, P] for R resamples:
    one length each), as vLLM's counters pool them: 1 + accepted drafts / verify steps."""
    k = hists[0].shape[1] - 1
    weights = np.arange(k + 1)
    accepted = sum((h @ weights)[pick].sum(-1) for h in hists)
    steps = sum(h.sum(1)[pick].sum(-1) for h in hists)
    return 1 + accepted / steps


def outputs(eagle3: np.ndarray) -> np.ndarray:
    """[prompts] each prompt's output tokens, counted from EAGLE-3's histograms (as
    ``histograms``; records from before evaluate wrote the figure keep no output counts): the
    same for every run under greedy decoding, and EAGLE-3 drafts at every step. Its steps, the
    drafts they accepted and the prompt's first token, from the prefill (a few tokens over vLLM's
    count where a request ends within a step's accepted drafts: 0.3% on the real model)."""
    return eagle3 @ np.arange(1, eagle3.shape[1] + 1) + 1


def per_pass(eagle3: np.ndarray, run: np.ndarray) -> float:
    """``run``'s output tokens a verifier pass (lib/evaluation/acceptance.py tokens_per_pass)
    on the prompts of ``eagle3``'s histograms, their output as ``outputs`` counts it."""
    accepted = run @ np.arange(run.shape[1])
    return tokens_per_pass(float(outputs(eagle3).sum()), float(accepted.sum()))


def paired_difference(a: list[np.ndarray], b: list[np.ndarray], seed: int = 0):
    """Pooled acceptance length of runs ``a`` minus runs ``b`` on the same prompts, and its 95%
    bootstrap interval (prompts resampled with replacement, the same draw for both)."""
    prompts = a[0].shape[0]
    pick = np.random.default_rng(seed).integers(0, prompts, size=(RESAMPLES, prompts))
    diff = pooled_length(a) - pooled_length(b)
    with np.errstate(invalid="ignore", divide="ignore"):  # a resample with no step: left out
        boot = pooled_length(a, pick) - pooled_length(b, pick)
    return float(diff), [float(v) for v in np.nanpercentile(boot, [2.5, 97.5])]


def load_runs(
    kept: Path, code: dict, build: dict | None = None
) -> tuple[dict[str, dict[int, dict]], list[str]]:
    """The runs kept by ``code`` and, where given, of the shared ``build`` (variant -> seed ->
    run), and the names of the others. Kept runs of different builds of the shared stages (a
    CPU of another kind, demo code that changed the verifier) are refused: their differences
    are not the variants'. A variant with a corpus of its own is held to the rest of the build."""
    done: dict[str, dict[int, dict]] = {}
    stale, builds = [], {}
    for variant in VARIANTS:
        for seed in SEEDS:
            path = kept / f"{run_name(variant, seed)}.json"
            if not path.is_file():
                continue
            run = json.loads(path.read_text())
            shared = held_to(variant, run["build"])
            if run["code"] != code or (build is not None and {**build, **shared} != build):
                stale.append(run_name(variant, seed))
                continue
            for part, sha in shared.items():  # each part of the build, by the runs sharing it
                builds.setdefault(part, {}).setdefault(sha, []).append(run_name(variant, seed))
            run["stages_s"] = run["train_evaluate_s"]
            done.setdefault(variant, {})[seed] = run
    for part, runs in builds.items():
        if len(runs) > 1:
            sys.exit(
                f"the runs kept in {kept} come from {len(runs)} builds of the shared stages (their "
                f"{part} differs: {'; '.join(', '.join(v) for v in runs.values())}), which "
                "cannot be compared: delete the files of the runs of all but one and run again"
            )
    return done, stale


def against(variant: str) -> str:
    """The variant a variant's paired differences are taken against (AGAINST, else the
    baseline)."""
    return AGAINST.get(variant, "baseline")


def elsewhere(variants) -> str:
    """The pairings other than against the baseline among ``variants``, for a table's caption."""
    pairs = [f"{v} against {AGAINST[v]}" for v in variants if v in AGAINST]
    return f" ({'; '.join(pairs)})" if pairs else ""


def seed_range(runs: dict[int, dict]) -> float:
    """The range of the runs' mean acceptance lengths over their seeds (training's noise)."""
    lengths = [r["results"]["summary"]["eagle3_mean_acceptance_length"] for r in runs.values()]
    return max(lengths) - min(lengths)


def table(done: dict[str, dict[int, dict]], default: tuple[str, ...] = DEFAULT) -> str:
    lines = [
        "| variant | setting | seeds | acceptance length, mean (range) | per position "
        "| simulated | vs baseline, paired [95% CI] | beyond noise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = done.get("baseline", {})
    hists = {v: [histograms(r["results"]) for r in runs.values()] for v, runs in done.items()}
    ngram = []
    wall = stages = 0.0
    for variant, runs in done.items():
        results = [r["results"] for r in runs.values()]
        wall += sum(r["wall_s"] * time_share(r) for r in runs.values())
        stages += sum(r["stages_s"] * time_share(r) for r in runs.values())
        lengths = [r["summary"]["eagle3_mean_acceptance_length"] for r in results]
        spread = seed_range(runs)
        simulated = [r["summary"]["eagle3_simulated_acceptance_length"] or 0 for r in results]
        ngram += [r["summary"]["ngram_mean_acceptance_length"] for r in results]
        rates = np.mean([r["runs"]["eagle3"]["acceptance_rate_per_position"] for r in results], 0)
        vs, beyond = "", ""
        ref = against(variant)
        if variant != ref and done.get(ref):
            diff, (lo, hi) = paired_difference(hists[variant], hists[ref])
            vs = (
                "" if ref == "baseline" else f"vs {ref}: "
            ) + f"{diff:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            noise = max(spread, seed_range(done[ref]))
            beyond = "yes" if (lo > 0 or hi < 0) and abs(diff) > noise else "no"
        lines.append(
            f"| {variant} | {VARIANTS[variant][0]} | {len(results)} "
            f"| {np.mean(lengths):.3f} ({min(lengths):.3f} to {max(lengths):.3f}) "
            f"| {' / '.join(f'{r:.3f}' for r in rates)} | {np.mean(simulated):.3f} | {vs} "
            f"| {beyond} |"
        )
    if ngram:
        runs = sum(len(r) for r in done.values())
        todo = sum(seed not in done.get(v, {}) for v in default for seed in SEEDS)
        any_run = next(iter(next(iter(done.values())).values()))["results"]
        ngram_ci = any_run["runs"]["ngram"]["per_prompt"]["mean_acceptance_length_ci95"]
        lines += [
            "",
            f"{any_run['num_prompts']} held-out prompts, {any_run['max_new_tokens']} new tokens, "
            f"k = {any_run['num_speculative_tokens']}, greedy. n-gram's acceptance length: "
            f"{min(ngram):.3f} to {max(ngram):.3f} [95% CI {ngram_ci[0]:.3f}, {ngram_ci[1]:.3f}]. "
            f"{runs} runs, {wall / 3600:.1f} h in all; "
            + (
                f"the {todo} runs of the plain benchmark's {len(default)} variants x "
                f"{len(SEEDS)} seeds not done take about {todo * stages / runs / 3600:.1f} h more"
                if todo
                else f"the plain benchmark's {len(default)} variants x {len(SEEDS)} seeds done"
            )
            + f" (training and evaluation: {stages / runs / 60:.0f} minutes a run; a run on a "
            "part of the machine's cores counts that part of its time).",
        ]
        eagle3 = histograms(any_run)
        ngram_steps, eagle3_steps = histograms(any_run, "ngram").sum(), eagle3.sum()
        lines.append(
            f"n-gram drafted at {ngram_steps:.0f} verify steps, EAGLE-3 at {eagle3_steps:.0f} "
            "(every one): in output tokens per forward pass of the verifier, which counts the "
            "steps where n-gram found nothing to propose, n-gram gives "
            f"{per_pass(eagle3, histograms(any_run, 'ngram')):.3f}."
        )
        for seed, run in base.items():
            s = run["results"]["summary"]
            lo, hi = s["eagle3_mean_acceptance_length_ci95"]
            eagle3, ngram = histograms(run["results"]), histograms(run["results"], "ngram")
            mine = per_pass(eagle3, eagle3)
            lines.append(
                f"baseline@{seed}: {s['eagle3_mean_acceptance_length']:.3f} [95% CI {lo:.3f}, "
                f"{hi:.3f}], {s['eagle3_over_ngram']:.3f}x n-gram; a verifier pass "
                f"{mine:.3f} tokens, {mine / per_pass(eagle3, ngram):.3f}x n-gram's"
            )
    tables = set_table(done) + repeat_table(done) + context_table(done)
    return "\n".join(lines + tables) + "\n"


def set_table(done: dict[str, dict[int, dict]]) -> list[str]:
    """Acceptance length per evaluation set (the runs that kept their sets, where there are
    several)."""
    runs = {v: [r["results"] for r in rs.values()] for v, rs in done.items()}
    runs = {v: rs for v, rs in runs.items() if all("sets" in r for r in rs)}
    if not runs or len(next(iter(runs.values()))[0]["sets"]) < 2:
        return []
    sets = next(iter(runs.values()))[0]["sets"]
    ends = np.cumsum([e["num_prompts"] for e in sets.values()])
    groups = {
        f"{name} ({e['num_prompts']})": np.arange(end - e["num_prompts"], end)
        for end, (name, e) in zip(ends, sets.items())
    }
    return group_table(runs, groups, "Acceptance length per evaluation set", "the set's prompts")


def repeats(results: dict) -> np.ndarray:
    """Per prompt, whether the verifier's text repeats itself or its prompt: n-gram (prompt
    lookup, the same greedy text) found a match to draft from at REPEATS or more of the
    verifier's passes. Its passes: the output (``outputs``) less the drafts n-gram accepted."""
    ngram = histograms(results, "ngram")
    passes = outputs(histograms(results)) - ngram @ np.arange(ngram.shape[1])
    return ngram.sum(1) >= REPEATS * passes


def repeat_table(done: dict[str, dict[int, dict]]) -> list[str]:
    """Acceptance length on the prompts whose text repeats (``repeats``) and on the others,
    where there are both: a draft that does not copy loses to n-gram on the first only."""
    runs = {v: [r["results"] for r in rs.values()] for v, rs in done.items()}
    if not runs:
        return []
    repeating = repeats(next(iter(runs.values()))[0])
    groups = {
        f"fresh text ({(~repeating).sum()})": np.flatnonzero(~repeating),
        f"repeating text ({repeating.sum()})": np.flatnonzero(repeating),
    }
    if not all(len(g) for g in groups.values()):
        return []
    return group_table(
        runs,
        groups,
        "Acceptance length on fresh and on repeating text: the prompts at fewer than "
        f"{REPEATS:.0%} of whose verifier passes n-gram found a match to draft from, and the rest",
        "the group's prompts",
    )


def group_table(
    runs: dict[str, list[dict]], groups: dict[str, np.ndarray], what: str, over: str
) -> list[str]:
    """``what``, a table of the runs' acceptance length on each group of prompts (name ->
    indices): per variant pooled over its seeds (range over the seeds) and, against the
    baseline, the paired difference [95% CI] over the group's prompts; n-gram's last, in vLLM's
    acceptance length and in output tokens a verifier pass."""
    lines = [
        "",
        f"{what}: pooled over the seeds (range over the seeds), and against the baseline"
        f"{elsewhere(runs)} the paired difference [95% CI] over {over}.",
        "",
        f"| variant | {' | '.join(groups)} |",
        f"|---|{'---|' * len(groups)}",
    ]
    each_run = {v: [histograms(r) for r in results] for v, results in runs.items()}
    base = each_run.get("baseline", [])
    ngram = histograms(next(iter(runs.values()))[0], "ngram")
    for variant, results in [*runs.items(), ("n-gram", None)]:
        hists = [ngram] if results is None else each_run[variant]
        ref = each_run.get(against(variant), [])
        cells = []
        for pick in groups.values():
            mine = [h[pick] for h in hists]
            cell = f"{float(pooled_length(mine)):.3f}"
            if len(mine) > 1:
                each = [float(pooled_length([h])) for h in mine]
                cell += f" ({min(each):.3f}-{max(each):.3f})"
            if results is not None and variant != against(variant) and ref:
                diff, (lo, hi) = paired_difference(mine, [h[pick] for h in ref])
                cell += f" {diff:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            cells.append(cell)
        lines.append(f"| {variant} | {' | '.join(cells)} |")
    if base:  # n-gram in tokens a verifier pass, on each group's output as the baseline drafted it
        cells = [f"{per_pass(base[0][pick], ngram[pick]):.3f}" for pick in groups.values()]
        lines.append(f"| n-gram, output tokens a verifier pass | {' | '.join(cells)} |")
    return lines


def by_context(results: dict, run: str = "eagle3") -> np.ndarray:
    """[prompts, buckets, k + 1] the per-prompt acceptance histograms by context length."""
    return np.array(results["runs"][run]["acceptance_histograms_by_context"], dtype=np.float64)


def context_table(done: dict[str, dict[int, dict]]) -> list[str]:
    """Acceptance length by context length (the runs that kept it): per variant and bucket
    pooled over its seeds, with the range over seeds, and the paired difference against the
    baseline over the prompts that reached the bucket; the last bucket's over the first's."""
    runs = {v: [r["results"] for r in rs.values()] for v, rs in done.items()}
    runs = {v: rs for v, rs in runs.items() if all("context_edges_tokens" in r for r in rs)}
    if not runs:
        return []
    edges = next(iter(runs.values()))[0]["context_edges_tokens"]
    names = [f"{a}-{b}" for a, b in zip([0, *edges], edges)]
    lines = [
        "",
        "Acceptance length by context length at the drafted position (tokens): pooled over the "
        "seeds (range over the seeds); against the baseline"
        f"{elsewhere(runs)}, the paired difference [95% CI] over the prompts that reached the "
        "bucket; last / first: the longest bucket reached over the shortest.",
        "",
        f"| variant | {' | '.join(names)} | last / first |",
        f"|---|{'---|' * len(names)}---|",
    ]
    each_run = {v: [by_context(r) for r in results] for v, results in runs.items()}
    ngram = by_context(next(iter(runs.values()))[0], "ngram")
    for variant, results in [*runs.items(), ("n-gram", None)]:
        hists = [ngram] if results is None else each_run[variant]
        ref = each_run.get(against(variant), [])
        cells, means = [], []
        for b in range(len(edges)):
            if not sum(h[:, b].sum() for h in hists):
                cells.append("")
                continue
            mean = float(pooled_length([h[:, b] for h in hists]))
            means.append(mean)
            each = [float(pooled_length([h[:, b]])) for h in hists]
            cell = f"{mean:.3f}" + (f" ({min(each):.3f}-{max(each):.3f})" if len(each) > 1 else "")
            if results is not None and variant != against(variant) and ref:
                reached = np.flatnonzero(sum(h[:, b].sum(-1) for h in hists + ref))
                diff, (lo, hi) = paired_difference(
                    [h[reached, b] for h in hists], [h[reached, b] for h in ref]
                )
                cell += f" {diff:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            cells.append(cell)
        ratio = f"{means[-1] / means[0]:.2f}" if means else ""
        lines.append(f"| {variant} | {' | '.join(cells)} | {ratio} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--bench",
        choices=list(BENCHES),
        default="quality",
        help="quality: config.quality.yaml; long: config.long.yaml (by context length); real: "
        "config.real.yaml (a real pretrained verifier, human-written prompts)",
    )
    ap.add_argument("--workdir", type=Path, help="default: bench_<bench> in the checkout")
    ap.add_argument("--kept", type=Path, help="where each run's record is kept")
    ap.add_argument("--configfile", type=Path, help="default: the benchmark's")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), help="run only these variants")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), choices=SEEDS)
    ap.add_argument("--cores", default="all")
    ap.add_argument(
        "--lanes", type=int, default=1, help="runs at once, each with its share of --cores"
    )
    ap.add_argument("--table", action="store_true", help="print the table of what is done")
    args = ap.parse_args()
    if args.lanes < 1:
        ap.error(f"--lanes {args.lanes}: at least 1 (the runs at once)")
    configfile, kept, default = BENCHES[args.bench]
    args.configfile = args.configfile or configfile
    args.kept = args.kept or kept
    args.workdir = args.workdir or ROOT / f"bench_{args.bench}"

    bench = args.workdir / "bench"
    results_dir = results_dir_of(args.workdir, args.configfile)
    code = code_now()

    def kept_runs(build: dict | None) -> dict[str, dict[int, dict]]:
        done, stale = load_runs(args.kept, code, build)
        if stale:
            print(
                f"{len(stale)} run(s) kept in {args.kept} were made by other code than this "
                f"checkout's{'' if build is None else ' or from another build'}: "
                f"{', '.join(stale)}; they are left out of the table and run again when asked for",
                flush=True,
            )
        return done

    def todo(done: dict) -> list[tuple[str, int]]:
        # seed by seed: a first table of every variant comes soonest
        return [
            (variant, seed)
            for seed in args.seeds
            for variant in args.only or default
            if seed not in done.get(variant, {})
        ]

    built = all((results_dir / rel).is_file() for rel in BUILT.values())
    build = build_of(results_dir) if built else None
    done = kept_runs(build)
    if not args.table and todo(done):
        if build is None:  # the first run builds the shared stages; kept runs are held to it
            run_all(args.workdir, args.kept, code, args.configfile, todo(done)[:1], args.cores, 1)
            build = build_of(results_dir)
            done = kept_runs(build)
        run_all(args.workdir, args.kept, code, args.configfile, todo(done), args.cores, args.lanes)
        done = kept_runs(build)
    text = table(done, default)
    if not done and (args.kept / "table.md").is_file():
        print(f"No run kept in {args.kept} counts for this code: its table.md is left as it is")
        print(text)
        return
    for where in (bench, args.kept):  # the kept table is the repository's copy of the results
        where.mkdir(parents=True, exist_ok=True)
        (where / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
