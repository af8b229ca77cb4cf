"""The evaluate stages' work: the held-out prompts served by the verifier in vLLM three times, each
engine in its own process (without speculation, with n-gram, with the EAGLE-3 draft), greedy and
optionally sampled, then, warm, timed at each concurrency (``speed``). The two engines that serve
no draft are ``reference(io, p)``'s (the evaluate_reference rule: served once for the prompts and
settings, whatever draft comes after; lib/evaluation/records.py ``References``); ``evaluate(io,
p)`` serves the draft and holds it to them: the acceptance from vLLM's counters with intervals
over prompts, per set and by context length; the greedy outputs with a speculator held to those
without; each speculator's speedup; and the summary (``EvalResults``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from workflow_scripts.lib.chat.template import load_template
from workflow_scripts.lib.common import UserError, read_json
from workflow_scripts.lib.evaluation.acceptance import (
    acceptance_by_context,
    acceptance_with_ci,
    load_prompt_sets,
    per_set,
    run_in_child,
    simulated_acceptance,
)
from workflow_scripts.lib.evaluation.records import EvalResults, PromptKey, References
from workflow_scripts.lib.evaluation.speed import device_description, speedups
from workflow_scripts.lib.verifier import engine, preflight
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.code_inputs import made_by
from workflow_scripts.lib.workflow.definitions import EvaluateParams
from workflow_scripts.lib.workflow.registry import EvaluateIO, EvaluateReferenceIO

log = logging.getLogger("eagle3")
REFERENCES = ("baseline", "ngram")  # the engines that serve no draft (evaluate_reference's)


def check_draft(io: EvaluateIO) -> None:
    draft_cfg = read_json(io.draft / "config.json")
    mla = draft_cfg.get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]
    if draft_cfg.get("speculators_model_type") != "eagle3" and not mla:
        raise UserError(
            f"{io.draft}/config.json is neither an EAGLE-3 speculators checkpoint nor an MLA "
            "EAGLE-3 draft (Eagle3DeepseekV2ForCausalLM)"
        )


def speculators(draft: Path | None, p: EvaluateParams, engine_args: dict) -> dict[str, Any]:
    """The engines' speculative configs: none, the draft (where ``draft`` is given), n-gram."""
    # vLLM selects a draft's attention backend anew: the one named for the verifier (the CPU's
    # reference MLA backend, lib/verifier/engine.py) is named for the draft too
    backend = {key: v for key, v in engine_args.items() if key == "attention_backend"}
    eagle3 = {
        "method": "eagle3",
        "model": str(draft),
        "num_speculative_tokens": p.num_speculative_tokens,
        **backend,
    }
    return {
        "baseline": None,
        **({"eagle3": eagle3} if draft is not None else {}),
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": p.num_speculative_tokens,
            "prompt_lookup_max": p.ngram_prompt_lookup_max,
            "prompt_lookup_min": p.ngram_prompt_lookup_min,
        },
    }


def engine_jobs(
    verifier: Path,
    draft: Path | None,
    p: EvaluateParams,
    prompts: list[dict],
    runs: list[tuple[str, float]],
) -> dict[str, dict[str, Any]]:
    """Per speculator (``speculators``), what its engine's process serves
    (acceptance.run_engine): the engine's arguments, the prompts, the runs (name, temperature)
    and the speed passes' concurrencies."""
    dtype = engine.resolve_dtype(p, verifier_files.verifier_config(verifier))
    engine_args = engine.engine_args(p, verifier, dtype, disable_log_stats=False)
    jobs = {}
    for name, spec in speculators(draft, p, engine_args).items():
        speculation = (
            # detailed: each verify step's accepted drafts, in order (acceptance by context)
            {"speculative_config": spec, "per_request_spec_decode_metrics": "detailed"}
            if spec
            else {}
        )
        jobs[name] = {
            "engine": {**engine_args, **speculation},
            "prompts": prompts,
            "runs": runs,
            "max_new_tokens": p.max_new_tokens,
            "seed": 0,
            "use_gpus": p.use_gpus,
            "verifier": str(verifier),
            "chat_template": p.chat_template.model_dump(),
            "max_model_len": p.max_model_len_tokens,
            "context_edges": p.context_edges(),
            "concurrency": p.concurrency,
            "speed_pass_min_s": p.speed_pass_min_s,
        }
    return jobs


def greedy_mismatches(prompts: list[dict], outputs: dict[str, list]) -> dict[str, list]:
    """Per speculator, the ids of the prompts whose greedy outputs differ from the verifier's
    alone (vLLM's speculative decoding is lossless: none)."""
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
    return mismatches


def served_prompts(verifier: Path, p: EvaluateParams) -> tuple[list[dict], list]:
    """The prompts of every set as the engines serve them, and the runs (name, temperature),
    after the checks that stop a job before an engine starts."""
    sets = p.eval_prompts.root
    template = load_template(verifier, p.chat_template)
    prompts = load_prompt_sets(sets, template, p.max_prompts, p.max_model_len_tokens)
    log.info(
        "evaluate: %d prompts: %s",
        len(prompts),
        ", ".join(f"{s.label} {sum(q['set'] == s.label for q in prompts)}" for s in sets),
    )
    verifier_cfg = verifier_files.verifier_config(verifier)
    preflight.check_evaluate(p, verifier_cfg)
    engine.check_devices(
        p, "evaluate", dtype=engine.resolve_dtype(p, verifier_cfg), verifier=verifier
    )
    runs = [("greedy", 0.0)]
    if p.sampled_temperature is not None:
        runs.append((f"temperature_{p.sampled_temperature:g}", p.sampled_temperature))
    return prompts, runs


def serve_engines(
    jobs: dict[str, dict[str, Any]], scratch: Path, edges: list[int]
) -> tuple[dict[str, Any], dict[str, list]]:
    """Each engine of ``jobs`` in its own process, one after another: per run (``<engine>`` for
    the greedy one, ``<engine>@<run>`` for the others) its results, with the acceptance and its
    intervals where it drafted, and its outputs."""
    scratch.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    outputs: dict[str, list] = {}
    for name, job in jobs.items():
        for run_name, run in run_in_child(job, scratch, name).items():
            key = name if run_name == "greedy" else f"{name}@{run_name}"
            outputs[key] = run.pop("outputs")
            if run["num_drafts"]:
                run["per_prompt"] = acceptance_with_ci(run["acceptance_histograms"])
                run["by_context"] = acceptance_by_context(
                    run["acceptance_histograms_by_context"], edges
                )
            results[key] = run
    for path in scratch.iterdir():
        path.unlink()
    scratch.rmdir()
    return results, outputs


def prompt_keys(prompts: list[dict]) -> list[PromptKey]:
    return [
        PromptKey(set=q["set"], id=q["id"], prompt_tokens=len(q["prompt_token_ids"]))
        for q in prompts
    ]


def reference(io: EvaluateReferenceIO, p: EvaluateParams) -> References:
    """The engines that serve no draft (REFERENCES), on every prompt: what evaluate holds each
    draft to."""
    prompts, runs = served_prompts(io.verifier, p)
    jobs = engine_jobs(io.verifier, None, p, prompts, runs)
    scratch = io.reference.parent / f".{io.reference.name}.engines"
    results, outputs = serve_engines(jobs, scratch, p.context_edges())
    return References(
        runs={key: {**run, "outputs": outputs[key]} for key, run in results.items()},
        prompts=prompt_keys(prompts),
        device=device_description(p.use_gpus),
        made_by=made_by("evaluate_reference"),
    )


def held_references(io: EvaluateIO, prompts: list[dict], runs: list) -> References:
    """evaluate_reference's record, refused where its engines served other prompts or runs than
    evaluate serves now (a file kept from other settings, or copied in by hand)."""
    refs = References.read(io.reference)
    wanted = {n if r == "greedy" else f"{n}@{r}" for n in REFERENCES for r, _ in runs}
    if refs.prompts != prompt_keys(prompts) or set(refs.runs) != wanted:
        raise UserError(
            f"{io.reference} holds other prompts or runs than evaluate serves now: run "
            "`snakemake --forcerun evaluate_reference` (its rule makes it from these settings)"
        )
    return refs


def evaluate(io: EvaluateIO, p: EvaluateParams) -> EvalResults:
    check_draft(io)
    sets = p.eval_prompts.root
    prompts, runs = served_prompts(io.verifier, p)
    refs = held_references(io, prompts, runs)
    k = p.num_speculative_tokens
    edges = p.context_edges()
    jobs = engine_jobs(io.verifier, io.draft, p, prompts, runs)
    scratch = io.results.parent / f".{io.results.name}.engines"
    mine, my_outputs = serve_engines({"eagle3": jobs["eagle3"]}, scratch, edges)
    # every run in the engines' order (the verifier alone, the draft, n-gram), as one record
    results: dict[str, Any] = {}
    outputs: dict[str, list] = {}
    for name in jobs:
        for key in [name, *(f"{name}@{run_name}" for run_name, _ in runs[1:])]:
            if name == "eagle3":
                results[key], outputs[key] = mine[key], my_outputs[key]
            else:
                ref = refs.runs[key]
                results[key] = ref.model_dump(mode="json", exclude_unset=True, exclude={"outputs"})
                outputs[key] = ref.outputs

    mismatches = greedy_mismatches(prompts, outputs)
    eagle, ngram = results["eagle3"], results["ngram"]
    gains = []
    timed = {s["concurrency"] for s in results["baseline"].get("speed") or []}
    if p.concurrency and timed != set(p.concurrency):
        log.warning(
            "evaluate: the engines without a draft were timed at concurrencies %s, this job at %s "
            "(an execution setting: nothing reran them): the speedups are those of both; "
            "`snakemake --forcerun evaluate_reference evaluate_draft` times them all again",
            sorted(timed),
            p.concurrency,
        )
    if p.concurrency and refs.device == device_description(p.use_gpus):
        gains = speedups(results)
    elif p.concurrency:
        log.warning(
            "evaluate: no speedups: the engines without a draft ran on %s, this job on %s; "
            "`snakemake --forcerun evaluate_reference evaluate_draft` serves them all again here",
            refs.device,
            device_description(p.use_gpus),
        )
    lowest = next((g for g in gains if g["set"] == "all"), {})
    simulated = simulated_acceptance(io.metrics, k)
    return EvalResults(
        runs=results,
        simulated=simulated,
        verifier=str(io.verifier),
        draft=str(io.draft),
        eval_prompts=[s.model_dump(mode="json", exclude_none=True) for s in sets],
        num_prompts=len(prompts),
        # each prompt's set, id, and tokens generated without a draft (all its turns), in the
        # order of the runs' per-prompt lists
        prompts=[
            {"set": q["set"], "id": q["id"], "generated_tokens": len(out)}
            for q, out in zip(prompts, outputs["baseline"])
        ],
        sets=per_set(prompts, results, edges, {k: [len(o) for o in v] for k, v in outputs.items()}),
        context_edges_tokens=edges,
        num_speculative_tokens=k,
        max_new_tokens=p.max_new_tokens,
        greedy_mismatches=mismatches,
        greedy_lossless=not any(mismatches.values()),
        speedups=gains,
        summary={
            "eagle3_mean_acceptance_length": eagle["mean_acceptance_length"],
            "eagle3_mean_acceptance_length_ci95": eagle.get("per_prompt", {}).get(
                "mean_acceptance_length_ci95"
            ),
            "eagle3_simulated_acceptance_length": (simulated or {}).get("mean_acceptance_length"),
            "ngram_mean_acceptance_length": ngram["mean_acceptance_length"],
            "eagle3_over_ngram": (
                eagle["mean_acceptance_length"] / ngram["mean_acceptance_length"]
                if eagle["mean_acceptance_length"] and ngram["mean_acceptance_length"]
                else None
            ),
            "eagle3_tokens_per_verifier_pass": eagle["tokens_per_verifier_pass"],
            "ngram_tokens_per_verifier_pass": ngram["tokens_per_verifier_pass"],
            "eagle3_over_ngram_per_pass": (
                eagle["tokens_per_verifier_pass"] / ngram["tokens_per_verifier_pass"]
                if eagle["tokens_per_verifier_pass"] and ngram["tokens_per_verifier_pass"]
                else None
            ),
            "speedup_concurrency": lowest.get("concurrency"),
            "eagle3_speedup": lowest.get("eagle3"),
            "ngram_speedup": lowest.get("ngram"),
        },
        made_by=made_by("evaluate"),
    )
