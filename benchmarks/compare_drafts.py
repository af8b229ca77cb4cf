"""Two recipes' drafts compared as the quality benchmark compares them, from their evaluations:
the pooled acceptance length of each, and the difference paired over the same prompts with its
95% bootstrap interval, overall and per evaluation set. For runs of your own verifier (on GPUs,
say): train each recipe into its own results_dir with the same eval_prompts and evaluate
settings, one or more seeds each, then

    python benchmarks/compare_drafts.py NEW/evaluate/results.json [...] \
        --against OLD/evaluate/results.json [...]

Several files on a side are that recipe's seeds, pooled. Each file is a results.json or a record
bench_quality.py keeps. The difference is beyond noise when its interval excludes 0 and it is
larger than both sides' seed ranges (with one seed a side, the interval alone speaks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import histograms, paired_difference, pooled_length  # noqa: E402


def load(path: Path) -> dict:
    """A results.json, or the results a bench_quality record keeps."""
    data = json.loads(path.read_text())
    return data.get("results", data)


def prompts_of(results: dict) -> list:
    """What identifies the prompts evaluated, in their order: their sets and ids where the file
    has them, else each set's prompt count."""
    if "prompts" in results:
        return [(p["set"], p["id"]) for p in results["prompts"]]
    return sets_of(results)


def compare(new: list[dict], old: list[dict]) -> dict:
    """The comparison of runs ``new`` against runs ``old`` (each a results dict)."""
    first = new[0]
    protocol = {k: first[k] for k in ("num_speculative_tokens", "max_new_tokens")}
    for r in new + old:
        if {k: r[k] for k in protocol} != protocol or prompts_of(r) != prompts_of(first):
            raise SystemExit(
                "the runs were not evaluated alike: each must have the same eval_prompts, "
                "evaluate.num_speculative_tokens and evaluate.max_new_tokens"
            )
    a, b = [histograms(r) for r in new], [histograms(r) for r in old]

    def side(hists: list[np.ndarray]) -> dict:
        lengths = [float(pooled_length([h])) for h in hists]
        return {"pooled": float(pooled_length(hists)), "seeds": lengths,
                "range": max(lengths) - min(lengths)}  # fmt: skip

    diff, ci = paired_difference(a, b)
    noise = max(side(a)["range"], side(b)["range"])
    out = {
        **protocol,
        "num_prompts": a[0].shape[0],
        "new": side(a),
        "against": side(b),
        "difference": diff,
        "ci95": ci,
        "beyond_noise": (ci[0] > 0 or ci[1] < 0) and abs(diff) > noise,
        "sets": {},
    }
    start = 0
    for name, count in sets_of(first):
        rows = slice(start, start + count)
        d, c = paired_difference([h[rows] for h in a], [h[rows] for h in b])
        out["sets"][name] = {"prompts": count, "difference": d, "ci95": c}
        start += count
    return out


def sets_of(results: dict) -> list[tuple[str, int]]:
    """Each evaluation set and its prompt count, in the histograms' order (set after set); one
    set, "all", where a record kept before sets were recorded has none."""
    if "sets" not in results:
        return [("all", results["num_prompts"])]
    return [(name, e["num_prompts"]) for name, e in results["sets"].items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("new", type=Path, nargs="+", help="the recipe's results (one per seed)")
    ap.add_argument("--against", type=Path, nargs="+", required=True, help="the other recipe's")
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = ap.parse_args()
    result = compare([load(p) for p in args.new], [load(p) for p in args.against])
    if args.json:
        print(json.dumps(result, indent=2))
        return
    lo, hi = result["ci95"]
    print(
        f"{result['num_prompts']} prompts, k = {result['num_speculative_tokens']}, "
        f"{result['max_new_tokens']} new tokens\n"
        f"new:     {result['new']['pooled']:.3f} ({len(result['new']['seeds'])} seeds, range "
        f"{result['new']['range']:.3f})\n"
        f"against: {result['against']['pooled']:.3f} ({len(result['against']['seeds'])} seeds, "
        f"range {result['against']['range']:.3f})\n"
        f"paired difference: {result['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}], "
        f"{'beyond noise' if result['beyond_noise'] else 'within noise'}"
    )
    for name, s in result["sets"].items():
        print(f"  {name} ({s['prompts']}): {s['difference']:+.3f} "
              f"[{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}]")  # fmt: skip


if __name__ == "__main__":
    main()
