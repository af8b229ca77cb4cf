"""The recipe, measured: one draft per variant on the quality benchmark (config.quality.yaml),
the same data and steps, scored by vLLM (greedy, mean acceptance length with a 95% bootstrap
interval over prompts, and per position), side by side with training's simulation.

    .venv/bin/python benchmarks/bench_quality.py                    # every variant
    .venv/bin/python benchmarks/bench_quality.py --only baseline aux_noise_0.05
    .venv/bin/python benchmarks/bench_quality.py --table            # the table of what is done

All variants run in one Snakemake working directory (--workdir), one after the other, as a user
would change the config: the workflow reruns exactly what a variant changes (a train setting:
train and evaluate; the draft vocabulary: vocab, train, evaluate; a storage dtype: extract too;
regeneration: everything after the demo), and reuses the rest (the verifier, the data, the
shards). They run in the order of VARIANTS, the most telling first. Each variant's evaluation
and training metrics are kept under <workdir>/bench/<variant>/, and a variant done before is not
run again (delete its directory to redo it), so an interrupted benchmark goes on where it stopped.
The baseline is trained with three seeds: the spread of their acceptance lengths is the
run-to-run noise each effect is set against (and so is the largest training-only effect, to tell
it from that noise).

Prints a Markdown table (also written to <workdir>/bench/table.md): mean acceptance length [95%
interval], the change against the baseline's seed 0, acceptance per position, training's
simulated acceptance length, and for storage dtypes the bytes per token against float32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# name -> (what it changes, config override); in the order they run
VARIANTS: dict[str, tuple[str, dict]] = {
    "baseline": ("today's recipe (config.quality.yaml)", {}),
    "baseline_seed1": ("train.seed: 1", {"train": {"seed": 1}}),
    "storage_float8": (
        "extract.storage_dtype: float8_e4m3fn",
        {"extract": {"storage_dtype": "float8_e4m3fn"}},
    ),
    "storage_bfloat16": (
        "extract.storage_dtype: bfloat16",
        {"extract": {"storage_dtype": "bfloat16"}},
    ),
    "aux_noise_0.05": ("train.aux_noise: 0.05", {"train": {"aux_noise": 0.05}}),
    "loss_top1_in_vocab": (
        "train.loss_positions: verifier_top1_in_draft_vocab",
        {"train": {"loss_positions": "verifier_top1_in_draft_vocab"}},
    ),
    "eagle3.1_norms": (
        "train.norm_before_fc and train.norm_output: true",
        {"train": {"norm_before_fc": True, "norm_output": True}},
    ),
    "step_decay_0.8": ("train.ttt_step_loss_decay: 0.8", {"train": {"ttt_step_loss_decay": 0.8}}),
    "ttt_steps_7": ("train.ttt_steps: 7", {"train": {"ttt_steps": 7}}),
    "draft_vocab_512": ("vocab.draft_vocab_size: 512", {"vocab": {"draft_vocab_size": 512}}),
    "draft_vocab_2048": (
        "vocab.draft_vocab_size: 2048 (the whole vocabulary)",
        {"vocab": {"draft_vocab_size": 2048}},
    ),
    "baseline_seed2": ("train.seed: 2", {"train": {"seed": 2}}),
    "norm_before_fc": ("train.norm_before_fc: true", {"train": {"norm_before_fc": True}}),
    "norm_output": ("train.norm_output: true", {"train": {"norm_output": True}}),
    "regenerate_greedy": (
        "regenerate.enabled: true (greedy answers)",
        {"regenerate": {"enabled": True, "temperature": 0.0}},
    ),
    "regenerate_sampled": (
        "regenerate.enabled: true, temperature 1.0",
        {"regenerate": {"enabled": True, "temperature": 1.0}},
    ),
    # the largest training-only effect above, tried with two more seeds
    "norm_output_seed1": (
        "train.norm_output: true, train.seed: 1",
        {"train": {"norm_output": True, "seed": 1}},
    ),
    "norm_output_seed2": (
        "train.norm_output: true, train.seed: 2",
        {"train": {"norm_output": True, "seed": 2}},
    ),
}
# the variants run with train.seed 0, 1, 2 (<name>, <name>_seed1, <name>_seed2): the spread of
# each group is the run-to-run noise
SEEDS = {
    name: (name, f"{name}_seed1", f"{name}_seed2")
    for name in VARIANTS
    if f"{name}_seed1" in VARIANTS
}


def run_variant(workdir: Path, configfile: Path, name: str, cores: str) -> dict:
    """Runs the workflow's evaluate target with the variant's settings; keeps its outputs."""
    out = workdir / "bench" / name
    override = workdir / "bench" / f"{name}.yaml"
    override.parent.mkdir(parents=True, exist_ok=True)
    override.write_text(yaml.safe_dump(VARIANTS[name][1] or {"train": {}}))
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "evaluate",
        "--snakefile", str(ROOT / "Snakefile"),
        "--directory", str(workdir),
        "--cores", cores,
        # config.yaml first: the Snakefile's own configfile is looked up in the working directory
        "--configfile", str(ROOT / "config.yaml"), str(configfile.resolve()), str(override),
    ]  # fmt: skip
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    print(f"[{name}] $ {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"[{name}] snakemake failed in {workdir}:\n{proc.stderr[-6000:]}")
    results_dir = workdir / yaml.safe_load(configfile.read_text()).get("results_dir", "results")
    tmp = out.with_name(f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(results_dir / "evaluate" / "results.json", tmp / "results.json")
    shutil.copy(results_dir / "train" / "metrics.jsonl", tmp / "metrics.jsonl")
    shutil.copy(results_dir / "extract" / "manifest.json", tmp / "manifest.json")
    (tmp / "wall_s").write_text(f"{time.monotonic() - start:.0f}\n")
    tmp.rename(out)
    print(f"[{name}] done in {time.monotonic() - start:.0f}s", flush=True)
    return load(out)


def load(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    return {"results": results, "disk": manifest.get("disk") or {}}


def bytes_vs_float32(disk: dict) -> str:
    """The shards' bytes against float32's (the manifest's disk section)."""
    entry = (disk.get("by_storage_dtype") or {}).get(disk.get("storage_dtype"))
    return f"{entry['vs_float32']:.3f}" if entry else ""


def table(done: dict[str, dict]) -> str:
    def eagle(name):
        return done[name]["results"]["runs"]["eagle3"]

    base = eagle("baseline")["mean_acceptance_length"] if "baseline" in done else None
    lines = [
        "| variant | setting | acceptance length [95% CI] | vs baseline | per position "
        "| simulated | n-gram | bytes/token vs float32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        if name not in done:
            continue
        run = eagle(name)
        per_prompt = run.get("per_prompt", {})
        lo, hi = per_prompt.get("mean_acceptance_length_ci95") or (float("nan"),) * 2
        length = run["mean_acceptance_length"]
        rates = " / ".join(f"{r:.3f}" for r in run["acceptance_rate_per_position"])
        summary = done[name]["results"]["summary"]
        simulated = summary.get("eagle3_simulated_acceptance_length")
        delta = f"{length - base:+.3f}" if base is not None else ""
        lines.append(
            f"| {name} | {VARIANTS[name][0]} | {length:.3f} [{lo:.3f}, {hi:.3f}] | {delta} "
            f"| {rates} | {simulated:.3f} | {summary['ngram_mean_acceptance_length']:.3f} "
            f"| {bytes_vs_float32(done[name]['disk'])} |"
            if simulated is not None
            else f"| {name} | {VARIANTS[name][0]} | {length:.3f} [{lo:.3f}, {hi:.3f}] | {delta} "
            f"| {rates} | | {summary['ngram_mean_acceptance_length']:.3f} | |"
        )
    for group, names in SEEDS.items():
        seeds = [eagle(s)["mean_acceptance_length"] for s in names if s in done]
        if len(seeds) > 1:
            lines.append("")
            lines.append(
                f"{group} over train.seed 0..{len(seeds) - 1}: acceptance length mean "
                f"{sum(seeds) / len(seeds):.3f}, {min(seeds):.3f} to {max(seeds):.3f} "
                f"(range {max(seeds) - min(seeds):.3f})."
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench_quality")
    ap.add_argument("--configfile", type=Path, default=ROOT / "config.quality.yaml")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), help="run only these variants")
    ap.add_argument("--cores", default="all")
    ap.add_argument("--table", action="store_true", help="print the table of what is done")
    args = ap.parse_args()

    bench = args.workdir / "bench"
    done = {n: load(bench / n) for n in VARIANTS if (bench / n / "results.json").is_file()}
    if not args.table:
        for name in VARIANTS:
            if (not args.only or name in args.only) and name not in done:
                done[name] = run_variant(args.workdir, args.configfile, name, args.cores)
    text = table(done)
    bench.mkdir(parents=True, exist_ok=True)
    (bench / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
