"""What a recipe's variant costs per optimizer step, against today's recipe, in one run: the
quality benchmark's train settings (config.yaml, then config.quality.yaml) with each variant of
bench_quality.py that changes train settings only, trained on the same steps of the quality
build's shards, already in memory. The variants alternate in blocks of the same steps, so that
load from other processes falls on all alike; the headline compares each variant's best block
(the least disturbed) with the baseline's, the median beside it.

    .venv/bin/python benchmarks/bench_recipe_cost.py                       # bench_quality/'s build
    .venv/bin/python benchmarks/bench_recipe_cost.py --only layers_2 topk_loss --rounds 6
    .venv/bin/python benchmarks/bench_recipe_cost.py --workdir bench_real \\
        --configfile config.real.yaml --only eagle3.1_norms real_speculators_equal_steps

Needs a quality build (bench_quality.py's first run, or `snakemake evaluate --configfile
config.quality.yaml`): its manifest, vocab map and verifier; or, with --workdir and --configfile,
another benchmark's build (the real model's: `bench_quality.py --bench real`'s workdir).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_quality import VARIANTS  # noqa: E402
from bench_train import scratch_io, timed  # noqa: E402
from workflow_scripts.lib.workflow.config import layered_files  # noqa: E402

from workflow_scripts.lib.training.loader import Loader  # noqa: E402
from workflow_scripts.lib.training.inputs import check_inputs  # noqa: E402
from workflow_scripts.lib.training.processes import setup_processes  # noqa: E402
from workflow_scripts.lib.training.trainer import Trainer  # noqa: E402
from workflow_scripts.lib.workflow.definitions import TrainParams  # noqa: E402
from workflow_scripts.lib.workflow.layout import Layout  # noqa: E402


def train_only(name: str) -> bool:
    """A variant that changes train settings only (the others rerun earlier stages)."""
    return set(VARIANTS[name][1]) <= {"train"}


def quality_train_settings(configfile: Path) -> dict:
    """The train settings of config.yaml with ``configfile`` over it, as Snakemake layers them."""
    return layered_files([ROOT / "config.yaml", configfile]).get("train") or {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench_quality")
    parser.add_argument("--configfile", type=Path, default=ROOT / "config.quality.yaml")
    candidates = [v for v in VARIANTS if train_only(v) and v != "baseline"]
    parser.add_argument("--only", nargs="+", choices=candidates, default=candidates)
    parser.add_argument("--steps-per-block", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    results = args.workdir / layered_files([ROOT / "config.yaml", args.configfile])["results_dir"]
    if not (Layout(results).extract.manifest).is_file():
        raise SystemExit(f"no quality build in {args.workdir}: run benchmarks/bench_quality.py")
    base = quality_train_settings(args.configfile)
    names = ["baseline", *args.only]
    block = args.steps_per_block
    trainers, steps = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            io = scratch_io(
                Layout(results).extract.manifest,
                Layout(results).vocab.vocab_map,
                results / "demo" / "verifier",
                Path(tmp) / name,
            )
            p = TrainParams(**{**base, **VARIANTS[name][1].get("train", {})})
            trainers[name] = trainer = Trainer(io, p, check_inputs(io, p), setup_processes(p))
            if steps is None:  # the same steps for all (read once, before any clock starts)
                loader = Loader(
                    trainer.inputs.index, trainer.plan, 0, block * (args.rounds + 1), 0, 1,
                    torch.float32, False, False,
                )  # fmt: skip
                steps = [loader.load(s) for s in range(block * (args.rounds + 1))]
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:  # warm-up block, not timed
            for data in steps[:block]:
                trainers[name].train_step(data)
        for r in range(args.rounds):
            chunk = steps[block * (r + 1) : block * (r + 2)]
            for name in names if r % 2 == 0 else names[::-1]:
                _, seconds = timed(trainers[name], chunk)
                times[name].append(seconds / block * 1000)
            print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.0f}" for n in names))
    best = {n: min(t) for n, t in times.items()}
    median = {n: statistics.median(t) for n, t in times.items()}
    print(
        f"\nms per optimizer step, best (median) of {args.rounds} blocks of {block} steps "
        f"({torch.get_num_threads()} thread(s)); x baseline:"
    )
    for name in names:
        print(
            f"  {name:>24}: {best[name]:7.1f} ({median[name]:7.1f})  "
            f"x{best[name] / best['baseline']:.2f} (median x{median[name] / median['baseline']:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
