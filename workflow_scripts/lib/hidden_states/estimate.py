"""The run's size before it starts: from prepare's counts (its ``stats.json``) and the verifier's
``config.json``, the verifier tokens extraction computes and the bytes its shards take on disk in
the configured storage dtype, against the free space where they go. What ``snakemake -n`` prints
(``lib/dryrun.py``) once prepare has run; before, one line saying how to get it early.

The bytes follow the shard layout (``shards.shard_layout``): per token its id, loss mask and the
auxiliary layers' states (with a float32 scale per layer in float8), per loss-masked token the
final state (with its scale), per sample two offsets, per shard its header. Prepare counts the
tokens and the loss-masked tokens of every sample it writes, so the estimate is the extract
job's disk plan (``disk_plan.py``) but for the headers, counted at ``HEADER_BYTES`` a shard (an
upper bound), when every sample fits ``extract.max_model_len_tokens`` and no sample's first token
is in the loss (the final state is stored at the positions before loss-masked tokens). No torch:
the dry-run stays within seconds.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.targets import stages_needed
from workflow_scripts.lib.verifier.engine import resolve_dtype
from workflow_scripts.lib.workflow.layout import Layout
from workflow_scripts.lib.workflow.records import PrepareStats, RegenerateStats

STORAGE_CHOICES = ("float32", "bfloat16", "float8_e4m3fn")  # disk_plan.py's, without torch
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
FP8 = "float8_e4m3fn"
SCALE_BYTES = 4  # float8: a float32 scale per token and layer
# A shard's header (its 8-byte length and the JSON of its tensors and metadata) is about 0.8 to
# 1.1 KiB; tests hold shard_layout's to this bound.
HEADER_BYTES = 2048
EARLY = "`snakemake --cores all prepare`, then `snakemake -n {targets}`"


@dataclass
class Counts:
    """What prepare wrote (its stats.json): samples (rows), their tokens and loss-masked tokens."""

    samples: int
    tokens: int
    loss_tokens: int


def shard_set_bytes(
    counts: Counts, shard_size: int, num_aux: int, hidden_size: int, storage: str
) -> tuple[int, int]:
    """(bytes on disk, shards) of ``counts`` in shards of ``shard_size`` samples, as
    ``shards.shard_layout`` lays them out; headers at their bound (``HEADER_BYTES``)."""
    shards = math.ceil(counts.samples / shard_size)
    scale = SCALE_BYTES if storage == FP8 else 0
    state = hidden_size * ELEMENT_BYTES[storage] + scale
    per_token = 8 + 1 + num_aux * state  # input id (int64), loss mask (uint8), auxiliary states
    total = (
        shards * HEADER_BYTES
        + 16 * (counts.samples + shards)  # sample and final offsets, int64, S + 1 each
        + counts.tokens * per_token
        + counts.loss_tokens * state  # the final state where the loss reads it
    )
    return total, shards


def prepared_counts(
    stats_path: Path,
    tokenized: Path,
    chat_data: Path,
    verifier_dir: Path,
    p_prepare,
    dated: bool = True,
) -> tuple[Counts | None, str | None]:
    """Prepare's counts, or None and why they are not those of the current settings: not made
    yet, made from other chat data, another verifier or other prepare settings, or (``dated``)
    older than the chat data. Regenerated chat data is not dated: its rule is a checkpoint,
    which rewrites the file with the same bytes when only its job count changed, and Snakemake
    then reruns nothing after it."""
    if not (stats_path.is_file() and tokenized.is_file()):
        return None, "prepare has not run"
    try:
        stats = PrepareStats.read(stats_path)
    except UserError:
        return None, f"{stats_path} is not prepare's statistics"
    counts = Counts(stats.rows_out, stats.tokens, stats.loss_masked_tokens)
    current = {
        "chat_data": os.path.abspath(chat_data),
        "verifier": os.path.abspath(verifier_dir),
        "max_seq_len_tokens": p_prepare.max_seq_len_tokens,
        "chat_template": p_prepare.chat_template.model_dump(mode="json"),
    }
    recorded = {
        "chat_data": os.path.abspath(stats.chat_data),
        "verifier": os.path.abspath(stats.verifier),
        "max_seq_len_tokens": stats.max_seq_len_tokens,
        "chat_template": stats.chat_template,
    }
    changed = [key for key in current if current[key] != recorded[key]]
    if changed:
        return None, f"prepare ran with another {' and '.join(changed)} than the config gives"
    if dated and chat_data.is_file() and chat_data.stat().st_mtime > stats_path.stat().st_mtime:
        return None, f"{chat_data} is newer than prepare's counts"
    return counts, None


def free_bytes(directory: Path) -> tuple[int, Path]:
    """Free bytes on the file system ``directory`` is (or will be) on, and the existing
    directory they were read from."""
    place = Path(os.path.abspath(directory))
    while not place.exists():
        place = place.parent
    return shutil.disk_usage(place).free, place


def present_bytes(shard_dir: Path) -> int:
    """Bytes of the shard files already in ``shard_dir``."""
    if not shard_dir.is_dir():
        return 0
    return sum(p.stat().st_size for p in shard_dir.glob("shard_*.safetensors"))


def size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 2**20:.3f} MiB"


def run_estimate(
    cfg,
    counts: Counts,
    stats_path: Path,
    verifier_cfg: dict[str, Any] | None,
    results_dir: Path,
    shard_dir: Path,
    regenerate_stats: Path,
    evaluates: bool,
) -> tuple[list[str], list[str]]:
    """The estimate as lines to print, and warnings (hidden states beyond the free space with no
    disk budget)."""
    p = cfg.extract
    lines = [
        f"Run estimate, from prepare's counts ({stats_path}; the extract job's disk plan gives "
        "the exact bytes before its model loads):",
        f"  extract: {counts.samples:,} samples, {counts.tokens:,} verifier tokens "
        f"({counts.loss_tokens:,} of them in the loss)",
    ]
    warnings: list[str] = []
    longest = p.max_model_len_tokens - 1  # one position is kept for the generated token
    if cfg.prepare.max_seq_len_tokens > longest:
        what = "stop extraction" if p.on_too_long == "fail" else "are skipped"
        lines.append(
            f"  (prepare.max_seq_len_tokens {cfg.prepare.max_seq_len_tokens} is above "
            f"extract.max_model_len_tokens {p.max_model_len_tokens} - 1: samples longer than "
            f"{longest} tokens {what}; the figures are an upper bound)"
        )
    if verifier_cfg is None:
        lines.append("  hidden states: their bytes follow once the verifier's config.json exists")
        return lines, warnings
    aux = verifier_files.aux_layer_ids(verifier_cfg, p.aux_layer_ids)
    hidden = int(verifier_cfg["hidden_size"])
    storage = resolve_dtype(p, verifier_cfg) if p.storage_dtype == "compute" else p.storage_dtype
    by_storage = {
        name: shard_set_bytes(counts, p.shard_size_samples, len(aux), hidden, name)[0]
        for name in dict.fromkeys([storage, *STORAGE_CHOICES])
    }
    total, shards = shard_set_bytes(counts, p.shard_size_samples, len(aux), hidden, storage)
    others = ", ".join(f"{name} {size(n)}" for name, n in by_storage.items() if name != storage)
    lines.append(
        f"  hidden states: {size(total)} in {shards:,} shard(s), stored in {storage} "
        f"(extract.storage_dtype; {others}): {len(aux)} auxiliary layers {aux} and the final "
        f"state where the loss reads it, hidden size {hidden}, "
        f"{total / max(counts.tokens, 1):,.1f} bytes per token"
    )
    free, place = free_bytes(results_dir)
    if p.disk_budget is not None:
        lines.append(
            f"  disk: {size(free)} free in {place}; extract.disk_budget {p.disk_budget!r}: "
            f"training keeps at most that of the {size(total)} on disk and computes the rest "
            "again each epoch (the peak and the verifier tokens over the epochs: the disk "
            "budget's plan, below)"
        )
    else:
        # shards already there are reused, or replaced: their room counts as free
        present = present_bytes(shard_dir)
        need = int(total * p.disk_margin)
        there = f" and {size(present)} of shards already in {shard_dir}" if present else ""
        lines.append(
            f"  disk: {size(free)} free in {place}{there}; {size(need)} needed with "
            f"extract.disk_margin {p.disk_margin}"
        )
        if need > free + present:
            smaller = (
                f"store less per token (extract.storage_dtype {FP8}: {size(by_storage[FP8])}), "
                if storage != FP8
                else ""
            )
            warnings.append(
                f"the hidden states take about {size(total)} in {storage} ({size(need)} with "
                f"extract.disk_margin {p.disk_margin}), more than the {size(free + present)} "
                f"free in {place}: set extract.disk_budget (e.g. '90%': training keeps what "
                f"fits and computes the rest again), {smaller}or use a results_dir on a larger "
                "disk; without, the extract job stops before its model loads"
            )
    if cfg.regenerate.enabled and regenerate_stats.is_file():
        try:
            regen = RegenerateStats.read(regenerate_stats)
            lines.append(
                f"  regenerate (done): {regen.prompt_tokens:,} prompt tokens, "
                f"{regen.generated_tokens:,} generated"
            )
        except UserError:  # made by other code: the dry-run plans it again
            pass
    if evaluates:
        e = cfg.evaluate
        runs = 1 + (e.sampled_temperature is not None)
        temperatures = ", greedy and sampled" if runs == 2 else ""
        most = max([e.max_new_tokens, *(s.max_new_tokens or 0 for s in e.eval_prompts.root)])
        own = "" if most == e.max_new_tokens else ", or a set's own max_new_tokens"
        lines.append(
            f"  evaluate: at most {3 * runs * most:,} generated tokens per prompt "
            f"turn (the baseline, eagle3 and ngram engines{temperatures}, "
            f"evaluate.max_new_tokens {e.max_new_tokens}{own} each)"
        )
        if e.concurrency:
            lines.append(
                f"  evaluate's speed passes: each engine serves every first turn at least "
                f"{2 * len(e.concurrency)} times more (concurrency {e.concurrency}, each untimed "
                f"then timed, the timed one again until evaluate.speed_pass_min_s "
                f"{e.speed_pass_min_s:g} s), each set at least {e.concurrency[-1]} requests a pass"
            )
    return lines, warnings


def early_line(targets: list[str], regenerates: bool, why: str) -> str:
    """How to get the estimate before the run when prepare's counts are not there (``why``)."""
    first = (
        "regeneration and prepare (the verifier answers the chat data first: a model load)"
        if regenerates
        else "prepare (it tokenizes the chat data, no model loads)"
    )
    return (
        f"Run estimate (verifier tokens, hidden states' bytes on disk): {why}; to get it "
        f"before the run, build {first} with " + EARLY.format(targets=" ".join(targets))
    )


def dry_run_report(
    cfg,
    targets: list[str],
    layout: Layout,
    verifier_dir: Path,
    chat_data: Path,
) -> tuple[list[str], list[str]]:
    """What the dry-run prints for ``targets`` (lines, warnings): the estimate where a target
    extracts and prepare's counts are those of the current settings, else how to get it early;
    nothing for a target that extracts nothing. ``layout``: the run's results_dir."""
    if not any("extract" in stages_needed(t) for t in targets):
        return [], []
    stats = layout.prepare.stats
    counts, why = prepared_counts(
        stats,
        layout.prepare.tokenized,
        chat_data,
        verifier_dir,
        cfg.prepare,
        dated=not cfg.regenerate.enabled,
    )
    if counts is None:
        return [early_line(targets, cfg.regenerate.enabled, why)], []
    try:
        verifier_cfg = verifier_files.verifier_config(verifier_dir)
    except UserError:  # not built yet (the embedded default's), or refused by the checks
        verifier_cfg = None
    return run_estimate(
        cfg,
        counts,
        stats,
        verifier_cfg,
        layout.root,
        layout.extract.shards,
        layout.regenerate.stats,
        any("evaluate" in stages_needed(t) for t in targets),
    )
