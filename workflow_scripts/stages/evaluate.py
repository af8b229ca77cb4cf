"""evaluate: the trained draft under real vLLM speculative decoding, against no draft and n-gram.

For the held-out prompts (chat template applied) it runs the verifier in vLLM three times, each
engine in its own process: without speculation, with the EAGLE-3 draft, and with vLLM's n-gram
(prompt lookup) speculator; greedy, and optionally also at a sampled temperature. From vLLM's own
counters it records mean acceptance length and the acceptance rate per draft position, and from
its per-request metrics a 95% bootstrap interval over prompts for each; beside them, what training
simulated for the draft on its held-out split. From wall-clock around ``generate`` the output
tokens/s. Greedy outputs with a speculator must equal the outputs without: every mismatch is
listed. Writes a JSON file and PNG plots.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from workflow_scripts.lib.chat.template import load_template
from workflow_scripts.lib.common import (
    UserError,
    atomic_path,
    read_json,
    run_main,
    write_json,
)
from workflow_scripts.lib.evaluation.acceptance import (
    acceptance_by_context,
    acceptance_with_ci,
    load_prompt_sets,
    per_set,
    run_in_child,
    simulated_acceptance,
)
from workflow_scripts.lib.evaluation.plots import plot
from workflow_scripts.lib.verifier import engine, preflight
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.code_inputs import made_by

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("evaluate")
    draft_cfg = read_json(io.draft / "config.json")
    mla = draft_cfg.get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]
    if draft_cfg.get("speculators_model_type") != "eagle3" and not mla:
        raise UserError(
            f"{io.draft}/config.json is neither an EAGLE-3 speculators checkpoint nor an MLA "
            "EAGLE-3 draft (Eagle3DeepseekV2ForCausalLM)"
        )
    sets = p.eval_prompts.root
    template = load_template(io.verifier, p.chat_template)
    prompts = load_prompt_sets(sets, template, p.max_prompts, p.max_model_len_tokens)
    log.info(
        "evaluate: %d prompts: %s",
        len(prompts),
        ", ".join(f"{s.label} {sum(q['set'] == s.label for q in prompts)}" for s in sets),
    )

    dtype = preflight.check_evaluate(p, verifier_files.verifier_config(io.verifier))
    engine.check_devices(p, "evaluate", dtype=dtype, verifier=io.verifier)
    engine_args = engine.engine_args(p, io.verifier, dtype, disable_log_stats=False)
    k = p.num_speculative_tokens
    # vLLM selects a draft's attention backend anew: the one named for the verifier (the CPU's
    # reference MLA backend, lib/verifier/engine.py) is named for the draft too
    backend = {key: v for key, v in engine_args.items() if key == "attention_backend"}
    speculators = {
        "baseline": None,
        "eagle3": {
            "method": "eagle3",
            "model": str(io.draft),
            "num_speculative_tokens": k,
            **backend,
        },
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": p.ngram_prompt_lookup_max,
            "prompt_lookup_min": p.ngram_prompt_lookup_min,
        },
    }
    runs = [("greedy", 0.0)]
    if p.sampled_temperature is not None:
        runs.append((f"temperature_{p.sampled_temperature:g}", p.sampled_temperature))

    edges = p.context_edges()
    results: dict[str, Any] = {"runs": {}}
    scratch = io.results.parent / f".{io.results.name}.engines"
    scratch.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, list] = {}
    for name, spec in speculators.items():
        speculation = (
            # detailed: each verify step's accepted drafts, in order (acceptance by context)
            {"speculative_config": spec, "per_request_spec_decode_metrics": "detailed"}
            if spec
            else {}
        )
        job = {
            "engine": {**engine_args, **speculation},
            "prompts": prompts,
            "runs": runs,
            "max_new_tokens": p.max_new_tokens,
            "seed": 0,
            "use_gpus": p.use_gpus,
            "verifier": str(io.verifier),
            "chat_template": p.chat_template.model_dump(),
            "max_model_len": p.max_model_len_tokens,
            "context_edges": edges,
        }
        for run_name, run in run_in_child(job, scratch, name).items():
            key = name if run_name == "greedy" else f"{name}@{run_name}"
            outputs[key] = run.pop("outputs")
            if run["num_drafts"]:
                run["per_prompt"] = acceptance_with_ci(run["acceptance_histograms"])
                run["by_context"] = acceptance_by_context(
                    run["acceptance_histograms_by_context"], edges
                )
            results["runs"][key] = run
    for path in scratch.iterdir():
        path.unlink()
    scratch.rmdir()

    mismatches = {}
    for name in ("eagle3", "ngram"):
        differ = [
            prompts[i]["id"]
            for i, (a, b) in enumerate(zip(outputs["baseline"], outputs[name]))
            if a != b
        ]
        mismatches[name] = differ
        if differ:
            log.warning(
                "evaluate: greedy outputs with %s differ from the verifier's alone for %d of %d "
                "prompts: %s",
                name,
                len(differ),
                len(prompts),
                ", ".join(map(str, differ[:10])),
            )
    base_tps = results["runs"]["baseline"]["output_tokens_per_s"]
    eagle, ngram = results["runs"]["eagle3"], results["runs"]["ngram"]
    results["simulated"] = simulated_acceptance(io.metrics, k)
    results.update(
        {
            "verifier": str(io.verifier),
            "draft": str(io.draft),
            "eval_prompts": [s.model_dump(mode="json", exclude_none=True) for s in sets],
            "num_prompts": len(prompts),
            # each prompt's set, id, and tokens generated without a draft (all its turns), in
            # the order of the runs' per-prompt lists
            "prompts": [
                {"set": q["set"], "id": q["id"], "generated_tokens": len(out)}
                for q, out in zip(prompts, outputs["baseline"])
            ],
            "sets": per_set(prompts, results["runs"], edges),
            "context_edges_tokens": edges,
            "num_speculative_tokens": k,
            "max_new_tokens": p.max_new_tokens,
            "greedy_mismatches": mismatches,
            "greedy_lossless": not any(mismatches.values()),
            "summary": {
                "eagle3_mean_acceptance_length": eagle["mean_acceptance_length"],
                "eagle3_mean_acceptance_length_ci95": eagle.get("per_prompt", {}).get(
                    "mean_acceptance_length_ci95"
                ),
                "eagle3_simulated_acceptance_length": (results["simulated"] or {}).get(
                    "mean_acceptance_length"
                ),
                "ngram_mean_acceptance_length": ngram["mean_acceptance_length"],
                "eagle3_over_ngram": (
                    eagle["mean_acceptance_length"] / ngram["mean_acceptance_length"]
                    if eagle["mean_acceptance_length"] and ngram["mean_acceptance_length"]
                    else None
                ),
                "eagle3_speedup": eagle["output_tokens_per_s"] / base_tps,
                "ngram_speedup": ngram["output_tokens_per_s"] / base_tps,
            },
        }
    )
    with atomic_path(io.plot_dir) as tmp_dir:
        plot(results, io.metrics, tmp_dir)
    write_json(io.results, {**results, "made_by": made_by("evaluate")})
    log.info("evaluate: %s", json.dumps(results["summary"]))


if __name__ == "__main__":
    run_main(main)
