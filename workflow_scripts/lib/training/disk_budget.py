"""A disk budget's plan (``extract.disk_budget``), made before any model loads: which shards
every step reads (from the training plan, ``loader.Plan``), the disk that needs, which shards are
kept across epochs, and what that costs against the unbounded run.

A shard's *occurrence* is its use in one epoch: from the first step that reads it to the last.
Disk needed at a step is what is live then: the kept shards, the held-out shards (the validation
split's samples, computed first and kept) and every other shard whose occurrence spans the step.
A budget below what that needs with nothing kept is refused; above, shards are kept across
epochs (first read first) as long as the peak stays within it, and the rest are recomputed at
each occurrence. The train job (``stream_consumer.py``) and the dry-run (``rules/train.smk``) plan alike.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workflow_scripts.lib.common import UserError, read_json
from workflow_scripts.lib.hidden_states import stream_producer as engine_side
from workflow_scripts.lib.hidden_states.records import StreamPlan
from workflow_scripts.lib.training.loader import Plan, split_samples
from workflow_scripts.lib.workflow.params_base import size_bytes


def budget_bytes(setting: str, directory: Path) -> int:
    """``extract.disk_budget`` in bytes: a size, or a share of the free space in ``directory``
    (counting what the stream's own files take already)."""
    text = setting.strip().lower().replace(" ", "")
    if text.endswith("%"):
        directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(directory).free + engine_side.used_bytes(directory)
        return int(free * float(text[:-1]) / 100)
    return size_bytes(text)


def gib(n: int | float) -> str:
    return f"{n / 2**30:.3f} GiB"


# --------------------------------------------------------------------------- the plan


@dataclass
class Occurrence:
    shard: int  # position in the stream plan's shard list
    epoch: int
    first: int  # the first and last global step (0-based) that read the shard in this epoch
    last: int


def occurrences(plan: Plan, shard_of: np.ndarray, start: int) -> list[Occurrence]:
    """Every shard occurrence from step ``start`` on, in the order of its first step."""
    found: dict[tuple[int, int], Occurrence] = {}
    for step in range(start, plan.total_steps):
        epoch, _ = plan.locate(step)
        ids = np.concatenate(plan.global_batch(step))
        for s in np.unique(shard_of[ids]).tolist():
            occ = found.get((s, epoch))
            if occ is None:
                found[(s, epoch)] = Occurrence(s, epoch, step, step)
            else:
                occ.last = step
    return sorted(found.values(), key=lambda o: (o.first, o.shard))


@dataclass
class BudgetPlan:
    budget: int
    sizes: np.ndarray  # bytes per shard
    tokens: np.ndarray  # tokens per shard
    heldout: list[engine_side.ShardPlan]
    occ: list[Occurrence]
    heldout_sizes: list[int] = field(default_factory=list)
    kept: set[int] = field(default_factory=set)
    peak: int = 0
    minimum: int = 0  # the least budget: nothing kept
    start: int = 0  # the step the run starts at (a resumed one's)

    @property
    def heldout_bytes(self) -> int:
        return sum(self.heldout_sizes)

    def computed(self) -> list[Occurrence]:
        """The occurrences the engine computes: each recomputed one, a kept shard's first."""
        seen: set[int] = set()
        out = []
        for o in self.occ:
            if o.shard in self.kept:
                if o.shard in seen:
                    continue
                seen.add(o.shard)
            out.append(o)
        return out

    def costs(self, epochs: int) -> dict[str, Any]:
        total_bytes, total_tokens = int(self.sizes.sum()), int(self.tokens.sum())
        streamed = [s for s in range(len(self.sizes)) if s not in self.kept]
        heldout_tokens = sum(s.num_tokens for s in self.heldout)
        computed = sum(int(self.tokens[o.shard]) for o in self.computed()) + heldout_tokens
        return {
            "budget_bytes": self.budget,
            "peak_bytes": self.peak,
            "least_budget_bytes": self.minimum,
            "unbounded_bytes": total_bytes,
            "heldout_bytes": self.heldout_bytes,
            "kept_shards": len(self.kept),
            "recomputed_shards": len(streamed),
            "shards": len(self.sizes),
            "recomputed_share": float(self.sizes[streamed].sum() / max(total_bytes, 1)),
            "verifier_tokens": computed,
            "unbounded_verifier_tokens": total_tokens,
            "extra_verifier_tokens": computed - total_tokens,
            "verifier_passes": computed / max(total_tokens, 1),
            "epochs": epochs,
            "from_step": self.start,
        }


def live_bytes(occ: list[Occurrence], sizes: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes of the shards live at each step of [start, stop) (their occurrences' spans)."""
    diff = np.zeros(max(stop - start, 1) + 1, dtype=np.int64)
    for o in occ:
        diff[o.first - start] += sizes[o.shard]
        diff[o.last - start + 1] -= sizes[o.shard]
    return np.cumsum(diff)[:-1]


def plan_budget(
    budget: int,
    sizes: np.ndarray,
    tokens: np.ndarray,
    heldout: list,
    heldout_sizes: list[int],
    occ: list[Occurrence],
    start: int,
    stop: int,
) -> BudgetPlan:
    """The kept shards (first read first, each as long as the peak stays within ``budget``),
    the peak and the least budget."""
    bp = BudgetPlan(budget, sizes, tokens, heldout, occ, heldout_sizes, start=start)
    live = live_bytes(occ, sizes, start, stop)
    fixed = bp.heldout_bytes
    bp.minimum = bp.peak = fixed + int(live.max(initial=0))
    by_shard: dict[int, list[Occurrence]] = {}
    for o in occ:
        by_shard.setdefault(o.shard, []).append(o)
    kept_bytes = 0
    for s, own in by_shard.items():
        trial = live - live_bytes(own, sizes, start, stop)
        peak = fixed + kept_bytes + int(sizes[s]) + int(trial.max(initial=0))
        if peak <= budget:
            bp.kept.add(s)
            kept_bytes += int(sizes[s])
            live, bp.peak = trial, peak
    return bp


def training_plan(num_samples: int, shard_of: np.ndarray, lengths, p, world: int):
    """The training plan as the trainer makes it (``Trainer.__init__``)."""
    train_ids, val_ids = split_samples(num_samples, p.validation_fraction, p.seed)
    plan = Plan(
        train_ids,
        lengths,
        p.micro_batch_budget_tokens,
        p.seed,
        p.epochs,
        world * p.grad_accum_steps,
        shard_of=shard_of,
        window=p.shuffle_window_shards,
    )
    return plan, val_ids


class SampleTable:
    """Every sample of the stream plan (ordinal g, as the manifest would number them): its
    shard (position in the plan's list), place in it, tokenized line, length, final rows."""

    def __init__(self, stream_plan: StreamPlan):
        shards = stream_plan.shards
        self.shard_of = np.concatenate(
            [np.full(len(s.samples), i, dtype=np.int64) for i, s in enumerate(shards)]
        )
        self.local_of = np.concatenate([np.arange(len(s.samples)) for s in shards])
        self.lines = np.concatenate([np.asarray(s.samples, dtype=np.int64) for s in shards])
        self.full_lengths = np.concatenate([np.asarray(s.lengths) for s in shards])
        self.final_rows = np.concatenate([np.asarray(s.final_rows) for s in shards])
        self.sizes = np.asarray([s.bytes for s in shards], dtype=np.int64)
        self.tokens = np.asarray([s.num_tokens for s in shards], dtype=np.int64)

    def heldout(self, stream_plan, val_ids: np.ndarray, directory: Path, shard_size: int):
        """The held-out shards: the validation split's samples, ``shard_size`` to a shard."""
        base = engine_side.plan_of(stream_plan)
        out = []
        for k, w in enumerate(range(0, len(val_ids), shard_size)):
            ids = val_ids[w : w + shard_size]
            out.append(
                engine_side.heldout_shard(
                    base,
                    k,
                    self.lines[ids].tolist(),
                    self.full_lengths[ids].tolist(),
                    self.final_rows[ids].tolist(),
                    [stream_plan.shards[s].fingerprint for s in self.shard_of[ids]],
                    directory,
                )
            )
        sizes = [base.shard_bytes(s) for s in out]
        return out, sizes


def budget_plan(stream_plan, p_train, budget: int, world: int, directory: Path, start: int = 0):
    """(BudgetPlan, training Plan, val ids, SampleTable) for a run from step ``start``."""
    table = SampleTable(stream_plan)
    lengths = np.minimum(table.full_lengths, p_train.micro_batch_budget_tokens)
    plan, val_ids = training_plan(len(table.lines), table.shard_of, lengths, p_train, world)
    heldout, heldout_sizes = table.heldout(
        stream_plan, val_ids, directory, stream_plan.shard_size_samples
    )
    occ = occurrences(plan, table.shard_of, start)
    bp = plan_budget(
        budget, table.sizes, table.tokens, heldout, heldout_sizes, occ, start, plan.total_steps
    )
    return bp, plan, val_ids, table


def plan_costs(stream_plan, p_train, p_extract, directory: Path) -> dict[str, Any]:
    """The costs of ``extract.disk_budget`` for a run from the start, as the train job will plan
    it; a UserError when the budget is below the least."""
    world = p_train.num_gpus if p_train.num_gpus > 0 else p_train.num_cpu_processes
    budget = budget_bytes(p_extract.disk_budget, directory)
    bp, _, _, _ = budget_plan(stream_plan, p_train, budget, world, directory)
    refuse_below_least(bp, p_extract.disk_budget, p_train)
    return bp.costs(p_train.epochs)


def refuse_below_least(bp: BudgetPlan, setting: str, p_train) -> None:
    if bp.budget >= bp.minimum:
        return
    window = p_train.shuffle_window_shards
    how = (
        "train.shuffle_window_shards is null, so every step reads from every shard: set it "
        "(e.g. 2) so that a step reads a few"
        if window is None
        else f"lower train.shuffle_window_shards ({window})"
    )
    raise UserError(
        f"extract.disk_budget {setting!r} is {gib(bp.budget)}, below what training needs on "
        f"disk at once: {gib(bp.minimum)} (the held-out split's states, {gib(bp.heldout_bytes)}, "
        "and every shard a step's window reads). Raise extract.disk_budget, or "
        f"{how}, or lower extract.shard_size_samples, or store less per token "
        "(extract.storage_dtype float8_e4m3fn)"
    )


def describe(costs: dict[str, Any]) -> str:
    span = f"{costs['epochs']} epoch(s)"
    if costs["from_step"]:
        span += f" from step {costs['from_step']} on"
    return (
        f"disk budget {gib(costs['budget_bytes'])}: peak {gib(costs['peak_bytes'])} of hidden "
        f"states on disk (unbounded: {gib(costs['unbounded_bytes'])}; least budget "
        f"{gib(costs['least_budget_bytes'])}); {costs['kept_shards']} of {costs['shards']} "
        f"shards kept across epochs, {costs['recomputed_shards']} recomputed each epoch "
        f"({costs['recomputed_share']:.1%} of the states); the verifier computes "
        f"{costs['verifier_tokens']:,} tokens over {span}, "
        f"{costs['verifier_passes']:.2f}x the unbounded run's {costs['unbounded_verifier_tokens']:,} "
        f"(+{costs['extra_verifier_tokens']:,})"
    )


def load_stream_plan(path: Path) -> StreamPlan:
    try:
        kind = read_json(path).get("kind")
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if kind != "stream_plan":
        raise UserError(
            f"{path} is not a stream plan (extract.disk_budget is set: training takes the "
            "extract_plan stage's output); rerun the workflow"
        )
    return StreamPlan.read(path)
