"""Serving speed as the evaluate stage measures it, twice in a row in each warm engine, and the
serving cost of other drafts beside the build's.

    python benchmarks/bench_serving.py [--configfile FILE ...] [--directory DIR]
        [--concurrency 1 4 16 64] [--draft NAME=DIR ...] [--json OUT.json]

It measures a build made in DIR (the working directory, by default this one) with the config files
given as to Snakemake (DIR/config.yaml, then each --configfile over it): the build's verifier,
draft and evaluation prompts, with evaluate's settings from those files, the engine's (use_gpus,
tensor_parallel_size, memory, ...) included; files whose evaluate settings are not the build's (its
results_dir/config.resolved.yaml) are refused. Each engine (the verifier alone, with the build's
draft, with n-gram, and with every --draft) is run by the stage's own code (lib/evaluation: one
process per engine, its acceptance pass, then the speed passes), with the speed passes at every
concurrency served twice in a row. Printed per engine and concurrency: output tokens/s of the first
and the second pass and their ratio (the second is the same engine already warm: how much of the
first is start-up or noise), the speedup over the verifier alone, the acceptance length, the draft
tokens proposed per second and vLLM's median time per output token; and each engine's start and
acceptance pass, the warm-up the passes leave out. CPU figures show the method's behaviour, not a
GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from workflow_scripts.lib.workflow.layout import Layout  # noqa: E402


def build_config(directory: Path, configfiles: list[Path]):
    """The config the build in ``directory`` was made with, from ``directory``/config.yaml (the
    project's where it has none) and ``configfiles`` (as given, from the current directory) over
    it, and the build's Layout. Like Snakemake's --directory it changes the working directory to
    ``directory``, so that the build's relative paths (results_dir, verifier, prompt files)
    resolve from there; the chat data's and the evaluation's sources as the jobs read them (the
    demo's files, sets known by name at their place: lib/data/resolve.py). SystemExit where there
    is no build or the files' evaluate settings are not the ones the build recorded
    (lib/dryrun.py: recorded_settings, dtype resolved as the rules resolve it)."""
    from workflow_scripts.lib.common import UserError
    from workflow_scripts.lib.data.resolve import resolve_sources
    from workflow_scripts.lib.dryrun import recorded_settings
    from workflow_scripts.lib.verifier.files import verifier_config
    from workflow_scripts.lib.workflow.config import ConfigError, load_config_files

    configfiles = [Path(f).resolve() for f in configfiles]
    os.chdir(directory)
    # a directory without one was built over the project's (bench_quality.py's runs)
    base = Path("config.yaml") if Path("config.yaml").is_file() else ROOT / "config.yaml"
    try:
        cfg = load_config_files([base, *configfiles])
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    layout = Layout(Path(cfg.results_dir))
    if not layout.resolved_config.is_file() or not layout.train.draft.is_dir():
        raise SystemExit(
            f"no build at {layout.root.resolve()} (its draft and config.resolved.yaml): build it "
            f"with `snakemake --cores all evaluate` and these config files, or name the config "
            f"files it was built with (--configfile) and its working directory (--directory)"
        )
    try:
        cfg.data.chat_data, cfg.evaluate.eval_prompts, _ = resolve_sources(
            cfg.data.chat_data, cfg.evaluate.eval_prompts, layout.demo.dir, layout.sources_lock
        )
    except UserError as exc:
        raise SystemExit(str(exc)) from None
    built = yaml.safe_load(layout.resolved_config.read_text())["evaluate"]
    verifier_cfg = verifier_config(cfg.verifier) if cfg.verifier else {}  # as rules/common.smk
    given = json.loads(recorded_settings(cfg, "evaluate", verifier_cfg))
    differ = sorted(k for k in given.keys() | built.keys() if given.get(k) != built.get(k))
    if differ:
        raise SystemExit(
            f"{layout.resolved_config.resolve()}: the build's evaluate settings differ from these "
            f"config files' ({', '.join(f'evaluate.{k}' for k in differ)}): name the config files "
            f"the build was made with (--configfile)"
        )
    return cfg, layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configfile", type=Path, nargs="+", default=[], help="as to Snakemake")
    ap.add_argument("--directory", type=Path, default=Path("."), help="the build's working dir")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--draft", action="append", default=[], help="NAME=DIR: another draft")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    a = ap.parse_args()

    from workflow_scripts.lib.chat.template import load_template
    from workflow_scripts.lib.evaluation.acceptance import load_prompt_sets, run_in_child
    from workflow_scripts.lib.evaluation.run import engine_jobs

    drafts = [
        (name, str(Path(path).resolve())) for name, path in (d.split("=", 1) for d in a.draft)
    ]
    out = a.json.resolve() if a.json else None
    cfg, layout = build_config(a.directory, a.configfile)  # and now in a.directory
    p = cfg.evaluate.model_copy(update={"concurrency": a.concurrency})
    verifier = layout.verifier(cfg.verifier)
    template = load_template(verifier, p.chat_template)
    prompts = load_prompt_sets(p.eval_prompts.root, template, p.max_prompts, p.max_model_len_tokens)
    jobs = engine_jobs(verifier, layout.train.draft, p, prompts, [("greedy", 0.0)])
    for name, path in drafts:
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
    if out:
        out.write_text(json.dumps({"runs": runs, "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
