"""evaluate: the trained draft under real vLLM speculative decoding, against no draft and n-gram.

For the held-out prompts (chat template applied) it runs the verifier in vLLM three times, each
engine in its own process: without speculation, with the EAGLE-3 draft, and with vLLM's n-gram
(prompt lookup) speculator; greedy, and optionally also at a sampled temperature. From vLLM's own
counters it records mean acceptance length and the acceptance rate per draft position; from
wall-clock around ``generate`` the output tokens/s. Greedy outputs with a speculator must equal
the outputs without: every mismatch is listed. Writes a JSON file and PNG plots.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

from workflow_scripts import cli
from workflow_scripts.chat import BadRow, normalize, prompt_ids
from workflow_scripts.common import UserError, atomic_path, read_json, run_main, write_json

log = logging.getLogger("eagle3")


def load_prompts(path: Path, tokenizer, limit: int | None) -> list[dict[str, Any]]:
    """Rows with 'messages' ending in a user turn, or a 'prompt' string; template applied."""
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("prompt"), str):
                    messages = [{"role": "user", "content": row["prompt"]}]
                else:
                    messages = normalize(row)
                if messages[-1]["role"] != "user":
                    raise BadRow("malformed", "the last message must be a user turn")
            except (json.JSONDecodeError, BadRow) as exc:
                raise UserError(f"{path}:{line_no}: not a usable prompt: {exc}") from None
            ids = prompt_ids(tokenizer, messages)
            prompts.append({"id": row.get("id", f"line{line_no}"), "prompt_token_ids": ids})
            if limit and len(prompts) >= limit:
                break
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


def _counter(metrics, name: str) -> float:
    return float(sum(m.value for m in metrics if m.name == name and hasattr(m, "value")))


def _vector(metrics, name: str) -> list[int]:
    total: list[int] = []
    for m in metrics:
        if m.name == name and hasattr(m, "values"):
            total = [a + b for a, b in zip(total, m.values)] if total else list(m.values)
    return total


def run_engine(job: dict[str, Any], out_path: str) -> None:
    """One engine, one configuration, in a child process; results to ``out_path`` (JSON)."""
    if job["cpu"]:
        # one CPU worker: run the engine core in this process, one compute thread per core
        # left after the scheduler's (more threads than free cores stall every parallel op)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    from vllm import LLM, SamplingParams

    engine = job["engine"]
    llm = LLM(disable_log_stats=False, **engine)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"]} for p in job["prompts"]]
    # warm-up: one short request, so that start-up cost is not counted as generation time
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    before = llm.get_metrics()
    results = {}
    for name, temperature in job["runs"]:
        params = SamplingParams(
            max_tokens=job["max_new_tokens"], temperature=temperature, seed=job["seed"]
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = llm.get_metrics()
        drafts = _counter(after, "vllm:spec_decode_num_drafts") - _counter(
            before, "vllm:spec_decode_num_drafts"
        )
        accepted = _counter(after, "vllm:spec_decode_num_accepted_tokens") - _counter(
            before, "vllm:spec_decode_num_accepted_tokens"
        )
        draft_tokens = _counter(after, "vllm:spec_decode_num_draft_tokens") - _counter(
            before, "vllm:spec_decode_num_draft_tokens"
        )
        per_pos_after = _vector(after, "vllm:spec_decode_num_accepted_tokens_per_pos")
        per_pos_before = _vector(before, "vllm:spec_decode_num_accepted_tokens_per_pos")
        per_pos = [a - (per_pos_before[i] if i < len(per_pos_before) else 0)
                   for i, a in enumerate(per_pos_after)]
        before = after
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        results[name] = {
            "temperature": temperature,
            "generation_s": elapsed,
            "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / elapsed,
            "num_drafts": drafts,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate_per_position": [a / drafts for a in per_pos] if drafts else [],
            "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        }
    Path(out_path).write_text(json.dumps(results))


def run_in_child(job: dict[str, Any], scratch: Path, name: str) -> dict[str, Any]:
    out = scratch / f"{name}.json"
    proc = mp.get_context("spawn").Process(target=run_engine, args=(job, str(out)))
    log.info("evaluate: starting engine '%s'", name)
    start = time.perf_counter()
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not out.exists():
        raise UserError(f"vLLM engine '{name}' failed (exit code {proc.exitcode}); see the log above")
    log.info("evaluate: engine '%s' done in %.0f s", name, time.perf_counter() - start)
    return json.loads(out.read_text())


def plot(results: dict[str, Any], metrics_path: Path, plot_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    runs = {k: v for k, v in results["runs"].items() if v["num_drafts"]}

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(runs), 1)
    for i, (name, run) in enumerate(runs.items()):
        rates = run["acceptance_rate_per_position"]
        ax.bar([p + 1 + (i - (len(runs) - 1) / 2) * width for p in range(len(rates))], rates,
               width=width, label=f"{name} (mean acceptance length {run['mean_acceptance_length']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance per draft position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_dir / "acceptance_per_position.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(runs)
    axes[0].bar(names, [runs[n]["mean_acceptance_length"] for n in names], color="tab:blue")
    axes[0].set_ylabel("mean acceptance length")
    axes[0].set_title(f"k = {results['num_speculative_tokens']} (max {results['num_speculative_tokens'] + 1})")
    all_runs = results["runs"]
    axes[1].bar(list(all_runs), [r["output_tokens_per_s"] for r in all_runs.values()], color="tab:green")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title("Throughput")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(plot_dir / "draft_vs_ngram.png", dpi=120)
    plt.close(fig)

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split", "train") == "train" and "loss" in r]
    val = [r for r in rows if r.get("split") == "val" and "loss" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for series, label in ((train, "train"), (val, "held-out")):
        if series:
            axes[0].plot([r["step"] for r in series], [r["loss"] for r in series], label=label)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss (forward KL)")
    axes[0].legend()
    source = val or train
    if source and "top1_agreement" in source[-1]:
        for k in range(len(source[-1]["top1_agreement"])):
            axes[1].plot([r["step"] for r in source], [r["top1_agreement"][k] for r in source],
                         label=f"TTT step {k}")
        axes[1].set_ylim(0, 1)
        axes[1].legend()
    axes[1].set_xlabel("step")
    axes[1].set_ylabel(f"top-1 agreement with the verifier ({'held-out' if val else 'train'})")
    fig.tight_layout()
    fig.savefig(plot_dir / "training_curves.png", dpi=120)
    plt.close(fig)


def main() -> None:
    io, p = cli.parse("evaluate")
    from transformers import AutoTokenizer

    draft_cfg = read_json(io.draft / "config.json")
    if draft_cfg.get("speculators_model_type") != "eagle3":
        raise UserError(f"{io.draft}/config.json is not an EAGLE-3 speculators checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(str(io.verifier))
    prompts = load_prompts(io.eval_prompts, tokenizer, p.max_prompts)
    log.info("evaluate: %d prompts from %s", len(prompts), io.eval_prompts)

    engine = {
        "model": str(io.verifier),
        "dtype": "auto" if p.use_gpus else "float32",
        "max_model_len": p.max_model_len_tokens,
        "gpu_memory_utilization": p.gpu_memory_utilization,
        "tensor_parallel_size": p.tensor_parallel_size,
        "enforce_eager": p.enforce_eager,
        "seed": 0,
    }
    if p.kv_cache_memory_bytes is not None:
        engine["kv_cache_memory_bytes"] = p.kv_cache_memory_bytes
    k = p.num_speculative_tokens
    speculators = {
        "baseline": None,
        "eagle3": {"method": "eagle3", "model": str(io.draft), "num_speculative_tokens": k},
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

    results: dict[str, Any] = {"runs": {}}
    scratch = io.results.parent / f".{io.results.name}.engines"
    scratch.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, list] = {}
    for name, spec in speculators.items():
        job = {
            "engine": {**engine, **({"speculative_config": spec} if spec else {})},
            "prompts": prompts,
            "runs": runs,
            "max_new_tokens": p.max_new_tokens,
            "seed": 0,
            "cpu": not p.use_gpus and p.tensor_parallel_size == 1,
        }
        for run_name, run in run_in_child(job, scratch, name).items():
            key = name if run_name == "greedy" else f"{name}@{run_name}"
            outputs[key] = run.pop("outputs")
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
                "prompts: %s", name, len(differ), len(prompts), ", ".join(map(str, differ[:10])),
            )
    base_tps = results["runs"]["baseline"]["output_tokens_per_s"]
    eagle, ngram = results["runs"]["eagle3"], results["runs"]["ngram"]
    results.update(
        {
            "verifier": str(io.verifier),
            "draft": str(io.draft),
            "eval_prompts": str(io.eval_prompts),
            "num_prompts": len(prompts),
            "num_speculative_tokens": k,
            "max_new_tokens": p.max_new_tokens,
            "greedy_mismatches": mismatches,
            "greedy_lossless": not any(mismatches.values()),
            "summary": {
                "eagle3_mean_acceptance_length": eagle["mean_acceptance_length"],
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
    write_json(io.results, results)
    log.info("evaluate: %s", json.dumps(results["summary"]))


if __name__ == "__main__":
    run_main(main)
