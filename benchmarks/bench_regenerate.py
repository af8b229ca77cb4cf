"""Self-distillation, measured: the acceptance length of a draft trained on the chat data as it
is, against drafts trained on the verifier's own answers (the regenerate stage), side by side in
one run of the real workflow on the embedded default.

    .venv/bin/python benchmarks/bench_regenerate.py                       # greedy answers
    .venv/bin/python benchmarks/bench_regenerate.py --temperatures 0 1.0  # and sampled ones
    .venv/bin/python benchmarks/bench_regenerate.py --configfile my.yaml  # other demo settings

Each variant is a Snakemake run of the `evaluate` target in its own directory under --workdir.
The first, with regenerate off, builds the embedded default (verifier, data, held-out prompts);
the others name those files as verifier, chat_data and eval_prompts, so every variant trains the
same way on the same conversations and is scored on the same prompts; only the assistant turns
differ. Prints, per variant: how many answers differ from the data's, the mean acceptance length
under vLLM (greedy, and with --sampled-temperature on GPUs), and the ratio to the first one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.workflow_run import snakemake  # noqa: E402
from workflow_scripts.lib.workflow.layout import STATS, Layout  # noqa: E402


def assistant_turns(path: Path) -> list[list[str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench_regenerate")
    ap.add_argument("--configfile", type=Path, default=ROOT / "config.yaml")
    ap.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0],
        help="regenerate.temperature of each regenerated variant",
    )  # fmt: skip
    ap.add_argument(
        "--sampled-temperature", type=float, default=None,
        help="evaluate.sampled_temperature of every variant, besides greedy (GPU configs only)",
    )  # fmt: skip
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    common = {"evaluate": {"sampled_temperature": args.sampled_temperature}}
    cfg = yaml.safe_load(args.configfile.read_text()) or {}
    for key in ("verifier", "chat_data", "eval_prompts"):
        if cfg.get(key):
            sys.exit(f"{args.configfile} names {key}: this benchmark runs on the embedded default")

    variants: dict[str, Path] = {}
    seconds: dict[str, float] = {}
    base = work / "original"
    overlay = work / "original.yaml"
    overlay.write_text(yaml.safe_dump({**common, "regenerate": {"enabled": False}}))
    seconds["original"] = snakemake(base, [args.configfile, overlay], "evaluate", cores=args.cores)
    variants["original"] = base
    demo = base / "results" / "demo"
    for t in args.temperatures:
        name = f"regenerated_t{t:g}"
        overlay = work / f"{name}.yaml"
        overlay.write_text(
            yaml.safe_dump(
                {
                    **common,
                    "verifier": str(demo / "verifier"),
                    "chat_data": str(demo / "chat_data.jsonl"),
                    "eval_prompts": str(demo / "eval_prompts.jsonl"),
                    "regenerate": {"enabled": True, "temperature": t},
                }
            )
        )
        seconds[name] = snakemake(
            work / name, [args.configfile, overlay], "evaluate", cores=args.cores
        )
        variants[name] = work / name

    original = assistant_turns(demo / "chat_data.jsonl")
    rows = []
    for name, path in variants.items():
        res = json.loads((Layout(path / "results").evaluate.results).read_text())
        runs = res["runs"]
        sampled = next((k for k in runs if k.startswith("eagle3@")), None)
        row = {
            "variant": name,
            "greedy": runs["eagle3"]["mean_acceptance_length"],
            "sampled": runs[sampled]["mean_acceptance_length"] if sampled else None,
            "seconds": seconds[name],
        }
        regen = path / "results" / "regenerate"
        if (regen / "chat_data.jsonl").exists():
            turns = assistant_turns(regen / "chat_data.jsonl")
            pairs = [(a, b) for x, y in zip(original, turns) for a, b in zip(x, y)]
            stats = json.loads((regen / STATS).read_text())
            row["answers_changed"] = sum(a != b for a, b in pairs) / len(pairs)
            row["regenerate_s"] = max(stats["job_seconds"])
            row["generated_tokens"] = stats["generated_tokens"]
            row["length_limited_turns"] = stats["length_limited_turns"]
        rows.append(row)

    first = rows[0]
    print(
        f"\nmean acceptance length (k={res['num_speculative_tokens']}, {res['num_prompts']} "
        "held-out prompts); changed: assistant turns that differ from the data's"
    )
    head = f"{'variant':<20} {'changed':>8} {'greedy':>8} {'ratio':>6}"
    print(head + (f" {'sampled':>8} {'ratio':>6}" if first["sampled"] else ""))
    for r in rows:
        changed = f"{r['answers_changed']:.1%}" if "answers_changed" in r else "-"
        line = f"{r['variant']:<20} {changed:>8} {r['greedy']:>8.3f} {r['greedy'] / first['greedy']:>6.3f}"
        if first["sampled"]:
            line += f" {r['sampled']:>8.3f} {r['sampled'] / first['sampled']:>6.3f}"
        print(line)
    (work / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\n{work / 'summary.json'}")


if __name__ == "__main__":
    main()
