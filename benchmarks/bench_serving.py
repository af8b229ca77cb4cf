"""Serving speed as the evaluate stage measures it, twice in a row in each warm engine, and the
serving cost of other drafts beside the build's.

    python benchmarks/bench_serving.py RESULTS_DIR [--concurrency 1 4 16 64]
        [--draft NAME=DIR ...] [--json OUT.json]

RESULTS_DIR is a built results_dir (its verifier, draft and evaluation prompts, the settings of
its config.resolved.yaml). Each engine (the verifier alone, with the build's draft, with n-gram,
and with every --draft) is run by the stage's own code (lib/evaluation: one process per engine,
its acceptance pass, then the speed passes), with the speed passes at every concurrency served
twice in a row. Printed per engine and concurrency: output tokens/s of the first and the second
pass and their ratio (the second is the same engine already warm: how much of the first is
start-up or noise), the speedup over the verifier alone, the acceptance length, the draft tokens
proposed per second and vLLM's median time per output token; and each engine's start and
acceptance pass, the warm-up the passes leave out. CPU figures show the method's behaviour, not
a GPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from workflow_scripts.lib.workflow.layout import Layout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--draft", action="append", default=[], help="NAME=DIR: another draft")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    a = ap.parse_args()

    from workflow_scripts.lib.chat.template import load_template
    from workflow_scripts.lib.evaluation.acceptance import load_prompt_sets, run_in_child
    from workflow_scripts.lib.evaluation.run import engine_jobs
    from workflow_scripts.lib.workflow.definitions import EvaluateParams
    from workflow_scripts.lib.workflow.registry import EvaluateIO

    resolved = yaml.safe_load((a.results_dir / "config.resolved.yaml").read_text())
    p = EvaluateParams.model_validate({**resolved["evaluate"], "concurrency": a.concurrency})
    layout = Layout(a.results_dir)
    io = EvaluateIO(
        verifier=Path(resolved.get("verifier") or layout.demo.verifier),
        draft=layout.train.draft,
        metrics=layout.train.metrics,
        results=layout.evaluate.results,
        plot_dir=layout.evaluate.plots,
    )
    template = load_template(io.verifier, p.chat_template)
    prompts = load_prompt_sets(p.eval_prompts.root, template, p.max_prompts, p.max_model_len_tokens)
    jobs = engine_jobs(io, p, prompts, [("greedy", 0.0)])
    for spec in a.draft:
        name, path = spec.split("=", 1)
        job = json.loads(json.dumps(jobs["eagle3"]))
        job["engine"]["speculative_config"]["model"] = path
        jobs[name] = job
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, job in jobs.items():
            job["concurrency"] = a.concurrency * 2  # every pass twice, the second already warm
            runs[name] = run_in_child(job, Path(scratch), name)["greedy"]
            runs[name].pop("outputs")

    print(f"{len(prompts)} prompts, {p.max_new_tokens} new tokens at most, greedy, "
          f"k = {p.num_speculative_tokens}")  # fmt: skip
    print("engine        start s  acc. pass s   c   tok/s 1st   tok/s 2nd  2nd/1st  speedup"
          "  acc. len  drafted/s  TPOT ms")  # fmt: skip
    n = len(a.concurrency)
    figures = {}
    for name, run in runs.items():
        figures[name] = []
        speed = run["speed"]
        for s in sorted({s["set"] for s in speed}):
            passes = [x for x in speed if x["set"] == s]
            for i, c in enumerate(a.concurrency):
                first, second = passes[i], passes[i + n]
                base = [x for x in runs["baseline"]["speed"] if x["set"] == s][i + n]
                row = {
                    "set": s,
                    "concurrency": c,
                    "first": first["output_tokens_per_s"],
                    "second": second["output_tokens_per_s"],
                    "second_over_first": second["output_tokens_per_s"]
                    / first["output_tokens_per_s"],
                    "speedup": second["output_tokens_per_s"] / base["output_tokens_per_s"],
                    "acceptance_length": second["mean_acceptance_length"],
                    "drafted_per_s": second["drafted_tokens_per_s"] or 0,
                    "tpot_ms": (second["tpot_median_s"] or 0) * 1e3,
                }
                figures[name].append(row)
                print(
                    f"{name:12} {run['engine_start_s']:8.1f} {run['generation_s']:12.2f} "
                    f"{c:3d} {row['first']:11.0f} {row['second']:11.0f} "
                    f"{row['second_over_first']:8.3f} {row['speedup']:8.3f} "
                    f"{row['acceptance_length'] or 1:9.3f} {row['drafted_per_s']:10.0f} "
                    f"{row['tpot_ms']:8.2f}"
                )
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
