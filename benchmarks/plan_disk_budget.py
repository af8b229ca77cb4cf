"""The disk budget's plan for a data set that is not here: what the train job would log before any
model loads (peak bytes, shards kept and recomputed, verifier tokens against the unbounded run),
for a config's training and extraction settings and a synthetic data set of the given size, with
shard bytes laid out exactly as extraction writes them (``shards.shard_layout``).

    .venv/bin/python benchmarks/plan_disk_budget.py --configfile config.kimi-k25-8x.yaml \\
        --hidden-size 7168 --num-layers 61 --tokens 400e6 --budget 2TB

Samples are --sample-tokens long (a spread of +-50%), the loss read at --loss-share of them
(the final state is stored only there). Training settings and the storage dtype are the config's;
--window sets train.shuffle_window_shards where the config has none.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from workflow_scripts.lib.workflow.config import layered_files  # noqa: E402
from tests import factories  # noqa: E402
from workflow_scripts.lib.hidden_states.records import StreamPlan  # noqa: E402
from workflow_scripts.lib.hidden_states.shards import TORCH_DTYPES, shard_layout  # noqa: E402
from workflow_scripts.lib.training import disk_budget  # noqa: E402
from workflow_scripts.lib.workflow.config import load_config  # noqa: E402


def synthetic_plan(args, cfg) -> StreamPlan:
    rng = np.random.default_rng(0)
    n = int(args.tokens // args.sample_tokens)
    lengths = rng.integers(args.sample_tokens // 2, args.sample_tokens * 3 // 2, n)
    storage = cfg.extract.storage_dtype
    storage = "bfloat16" if storage == "compute" else storage
    meta = {"fingerprint": "0" * 64, "skipped_samples": "[]", "aux_layer_ids": "[2, 30, 58]"}
    size = cfg.extract.shard_size_samples
    shards = []
    for i, start in enumerate(range(0, n, size)):
        ls = lengths[start : start + size]
        final = (ls * args.loss_share).astype(int)
        layout = shard_layout(
            len(ls),
            int(ls.sum()),
            int(final.sum()),
            3,
            args.hidden_size,
            TORCH_DTYPES[storage],
            meta,
        )
        shards.append(
            {
                "index": i,
                "file": f"shard_{i:06d}.safetensors",
                "samples": list(range(start, start + len(ls))),
                "lengths": ls.tolist(),
                "final_rows": final.tolist(),
                "num_tokens": int(ls.sum()),
                "bytes": layout.file_bytes,
                "fingerprint": str(i),
            }
        )
    return factories.stream_plan(
        shards,
        {"dtype": "bfloat16", "code": "c"},
        num_hidden_layers=args.num_layers,
        final_layer_id=args.num_layers,
        hidden_size=args.hidden_size,
        vocab_size=1,
        aux_layer_ids=[2, args.num_layers // 2, args.num_layers - 3],
        dtype="bfloat16",
        storage_dtype=storage,
        shard_size_samples=size,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configfile", type=Path, required=True)
    ap.add_argument("--hidden-size", type=int, required=True)
    ap.add_argument("--num-layers", type=int, required=True)
    ap.add_argument("--tokens", type=float, required=True)
    ap.add_argument("--sample-tokens", type=int, default=4096)
    ap.add_argument("--loss-share", type=float, default=0.5)
    ap.add_argument("--budget", required=True)
    ap.add_argument("--window", type=int, default=4)
    args = ap.parse_args()
    raw = layered_files([ROOT / "config.yaml", args.configfile])
    raw["extract"]["disk_budget"] = args.budget
    raw["train"].setdefault("shuffle_window_shards", args.window)
    raw["verifier"] = None
    cfg = load_config(raw)
    plan = synthetic_plan(args, cfg)
    tokens = plan.num_tokens
    print(
        f"{plan.num_samples:,} samples, {tokens:,} tokens in {len(plan.shards)} shards of "
        f"{cfg.extract.shard_size_samples}: {plan.bytes / 1e12:.2f} TB of hidden states in "
        f"{plan.storage_dtype} ({plan.bytes / tokens / 1e3:.1f} KB per token); "
        f"train.shuffle_window_shards {cfg.train.shuffle_window_shards}, {cfg.train.epochs} epochs"
    )
    costs = disk_budget.plan_costs(plan, cfg.train, cfg.extract, Path("."))
    print(disk_budget.describe(costs))
    print(
        f"peak {costs['peak_bytes'] / 1e12:.2f} TB of a {costs['budget_bytes'] / 1e12:.2f} TB "
        f"budget (least {costs['least_budget_bytes'] / 1e12:.3f} TB); held-out split "
        f"{costs['heldout_bytes'] / 1e12:.3f} TB; extra verifier tokens "
        f"{costs['extra_verifier_tokens'] / 1e9:.2f}B ({costs['verifier_passes']:.2f} passes)"
    )


if __name__ == "__main__":
    main()
