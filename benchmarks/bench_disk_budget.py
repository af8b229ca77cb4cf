"""extract.disk_budget, measured: drafts of the quality build (config.quality.yaml) trained with
every hidden state on disk (extraction, then training), and within budgets of all of the set, a
half and a tenth (training runs the engine and reads shards as they come), side by side in one
working directory, one after the other, as a user would change the config.

    .venv/bin/python benchmarks/bench_disk_budget.py --workdir /tmp/bench-budget
    .venv/bin/python benchmarks/bench_disk_budget.py --workdir /tmp/bench-budget --budgets 0.1

Every run uses the same training order (train.shuffle_window_shards, --window) and shards of
--shard-size samples, so that the drafts can be compared byte for byte. Per run: the peak disk of
hidden states (sampled every 0.1 s while it runs: the files in the shard directory), the wall
time of the hidden states and training (the Snakemake run less its evaluation), the tokens the
verifier computed (the extraction's, or the sum of the engine's finished shards), each against
the unbounded run; the acceptance length vLLM measures (with its 95% interval) and whether the
draft is the unbounded run's, byte for byte. The stages every run shares (the verifier, the
regenerated data, the tokenized data, the vocab map) are built first and not timed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.workflow_run import snakemake, stage_seconds  # noqa: E402
from workflow_scripts.lib.workflow.config import layered_files  # noqa: E402
from workflow_scripts.lib.common import sha256_file  # noqa: E402
from workflow_scripts.lib.evaluation.records import EvalResults  # noqa: E402
from workflow_scripts.lib.hidden_states.records import Manifest, StreamPlan  # noqa: E402
from workflow_scripts.lib.hidden_states.stream_producer import used_bytes  # noqa: E402
from workflow_scripts.lib.workflow.layout import Layout  # noqa: E402

ENGINE_SHARD = re.compile(r"shard -?\d+ done: \d+ samples, (\d+) tokens")


class Sampler(threading.Thread):
    """The peak bytes of the shard files in ``directory`` while it runs."""

    def __init__(self, directory: Path):
        super().__init__(daemon=True)
        self.directory, self.peak, self.done = directory, 0, threading.Event()

    def run(self):
        while not self.done.is_set():
            if self.directory.is_dir():
                try:
                    self.peak = max(self.peak, used_bytes(self.directory))
                except FileNotFoundError:
                    pass
            time.sleep(0.1)


def run(args, label: str, fraction: float | None, whole: int) -> dict:
    workdir, results = args.workdir, args.workdir / args.results_dir
    extract = {"shard_size_samples": args.shard_size}
    if fraction is not None:
        extract["disk_budget"] = f"{int(fraction * whole)}B"
    override = workdir / f"bench-{re.sub(r'[^a-z0-9.]+', '-', label)}.yaml"
    train = {"shuffle_window_shards": args.window}
    if args.epochs is not None:
        train["epochs"] = args.epochs
    override.write_text(yaml.safe_dump({"extract": extract, "train": train}))
    # a fresh run: no shard of another run, no training state to resume
    for path in ("extract/shards", "extract/stream", "extract/parts", "train"):
        shutil.rmtree(results / path, ignore_errors=True)
    (Layout(results).extract.manifest).unlink(missing_ok=True)
    directory = results / "extract" / ("shards" if fraction is None else "stream")
    sampler = Sampler(directory)
    sampler.start()
    force = ["extract", "train"] if fraction is None else ["extract_plan", "train"]
    wall = snakemake(
        workdir, [args.configfile, override], "evaluate", "--forcerun", *force, cores=args.cores
    )
    sampler.done.set()
    sampler.join()
    wall -= stage_seconds(results, "evaluate")
    if fraction is None:
        tokens = Manifest.read(Layout(results).extract.manifest).num_tokens
    else:
        text = (results / "train" / "state" / "engine.log").read_text()
        tokens = sum(int(n) for n in ENGINE_SHARD.findall(text))
    summary = EvalResults.read(Layout(results).evaluate.results).summary
    row = {
        "label": label,
        "budget_bytes": None if fraction is None else int(fraction * whole),
        "peak_bytes": sampler.peak,
        "wall_s": round(wall, 1),
        "verifier_tokens": tokens,
        "acceptance_length": summary.eagle3_mean_acceptance_length,
        "acceptance_ci95": summary.eagle3_mean_acceptance_length_ci95,
        "draft_sha256": sha256_file(results / "train" / "draft" / "model.safetensors"),
    }
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict], whole: int) -> str:
    base = rows[0]
    lines = [
        "| hidden states | budget | sampled peak | wall time | verifier tokens | acceptance "
        "length [95% interval] | the unbounded draft |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 2**20:.0f} MiB"
        lo, hi = r["acceptance_ci95"]
        lines.append(
            f"| {r['label']} | {budget} | {r['peak_bytes'] / 2**20:.0f} MiB "
            f"({r['peak_bytes'] / whole:.2f} of the set) | {r['wall_s']:.0f} s "
            f"({r['wall_s'] / base['wall_s']:.2f}x) | {r['verifier_tokens']:,} "
            f"({r['verifier_tokens'] / base['verifier_tokens']:.2f}x) | "
            f"{r['acceptance_length']:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{'same bytes' if r['draft_sha256'] == base['draft_sha256'] else 'differs'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--configfile", type=Path, default=ROOT / "config.quality.yaml")
    ap.add_argument("--cores", default="all")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.1])
    ap.add_argument("--window", type=int, default=1, help="train.shuffle_window_shards")
    ap.add_argument("--shard-size", type=int, default=64, help="extract.shard_size_samples")
    ap.add_argument("--epochs", type=int, default=None, help="train.epochs (default: the config's)")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.configfile = args.configfile.resolve()
    args.results_dir = layered_files([ROOT / "config.yaml", args.configfile])["results_dir"]

    shared = args.workdir / "bench-shared.yaml"
    shared.write_text(yaml.safe_dump({"extract": {"shard_size_samples": args.shard_size}}))
    stream_plan = Layout(args.workdir / args.results_dir).extract.stream_plan
    snakemake(
        args.workdir,
        [args.configfile, shared],
        "vocab_map",
        str(stream_plan.relative_to(args.workdir)),
        cores=args.cores,
    )
    whole = StreamPlan.read(stream_plan).bytes
    print(f"the set's hidden states: {whole / 2**20:.1f} MiB", flush=True)
    rows = [run(args, "all on disk (no budget)", None, whole)]
    for fraction in args.budgets:
        rows.append(run(args, f"budget {fraction:g} of the set", fraction, whole))
    out = table(rows, whole)
    (args.workdir / "bench-disk-budget.md").write_text(out + "\n")
    (args.workdir / "bench-disk-budget.json").write_text(json.dumps(rows, indent=1))
    print(out)


if __name__ == "__main__":
    main()
