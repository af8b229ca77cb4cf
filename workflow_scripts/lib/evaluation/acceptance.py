"""Evaluation, everything but the entry: the held-out prompts, one vLLM engine per speculator
run in a child process of its own (on the CPU forked from a server that imported vLLM once), the
figures read from vLLM's own counters, and per prompt (vLLM's per-request speculative-decoding
metrics) a bootstrap confidence interval over prompts.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import numpy as np

from workflow_scripts.lib.chat.rows import BadRow, Conversation, normalize, parse_line, read_lines
from workflow_scripts.lib.common import UserError, write_json
from workflow_scripts.lib.verifier.engine import close_llm, make_llm

log = logging.getLogger("eagle3")
CHILD_EXIT_S = 10  # seconds an engine's process gets to exit once it has written its results
BOOTSTRAP_RESAMPLES = 2000


def prompt_conversation(row) -> Conversation:
    """A prompt row: ``{"prompt": text}``, or 'messages' / 'conversations' (earlier turns, tool
    calls and results, a row-level 'tools' list) ending in a user turn or a tool result."""
    if isinstance(row, dict) and "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise BadRow("malformed", "'prompt' must be a string")
        return Conversation(messages=[{"role": "user", "content": row["prompt"]}])
    conv = normalize(row)
    if conv.messages[-1]["role"] not in ("user", "tool"):
        raise BadRow("malformed", "the last message must be a user turn or a tool result")
    return conv


def load_prompts(path: Path, template, limit: int | None) -> list[dict[str, Any]]:
    """The prompts as the verifier is served them (``template``: the ChatTemplate with the
    serving-time arguments); any bad row stops with file, line and what is wrong (the held-out
    prompts are few and must all be usable)."""
    prompts = []
    for line_no, line in read_lines(path):
        try:
            row = parse_line(line)
            conv = prompt_conversation(row)
            ids = template.prompt_ids(conv.messages, conv.tools)
        except BadRow as exc:
            raise UserError(f"{path}:{line_no}: not a usable prompt: {exc}") from None
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
    from vllm import SamplingParams

    # one CPU worker: the engine core runs in this process (see engine.make_llm)
    llm = make_llm(job["engine"], use_gpus=job["use_gpus"])
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
        per_pos = [
            a - (per_pos_before[i] if i < len(per_pos_before) else 0)
            for i, a in enumerate(per_pos_after)
        ]
        before = after
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        metrics = [o.outputs[0].spec_decode_metrics for o in outputs]
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
            # per prompt: how many verify steps accepted j = 0..k draft tokens
            "acceptance_histograms": [list(m.histogram) if m else None for m in metrics],
            "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        }
    write_json(out_path, results)  # atomically: the parent waits for this file
    close_llm(llm)


def acceptance_with_ci(
    histograms: list[list[int] | None], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> dict[str, Any]:
    """Mean acceptance length and acceptance rate per draft position, pooled over prompts as
    vLLM's counters pool them, each with a 95% percentile-bootstrap interval over prompts
    (prompts resampled with replacement, seeded): how far another set of prompts like these
    could move the figure."""
    rows = np.array([h for h in histograms if h and sum(h)], dtype=np.float64)  # [P, k + 1]
    if len(rows) == 0:
        return {"num_prompts": 0}
    k = rows.shape[1] - 1
    steps = rows.sum(1)  # verify steps with drafts, per prompt
    # accepted at position i: steps that accepted more than i draft tokens
    at = np.stack([rows[:, i + 1 :].sum(1) for i in range(k)], axis=1)  # [P, k]
    pick = np.random.default_rng(seed).integers(0, len(rows), size=(resamples, len(rows)))
    boot_steps = steps[pick].sum(1)
    boot_at = at[pick].sum(1) / boot_steps[:, None]  # [R, k]
    boot_length = 1 + boot_at.sum(1)

    def interval(x):
        return [round(float(v), 6) for v in np.percentile(x, [2.5, 97.5])]

    rates = at.sum(0) / steps.sum()
    return {
        "num_prompts": len(rows),
        "mean_acceptance_length": float(1 + rates.sum()),
        "mean_acceptance_length_ci95": interval(boot_length),
        "acceptance_rate_per_position": [float(r) for r in rates],
        "acceptance_rate_per_position_ci95": [interval(boot_at[:, i]) for i in range(k)],
    }


def simulated_acceptance(metrics_path: Path, k: int) -> dict[str, Any] | None:
    """What training simulated for the draft it wrote, on its held-out split: the ``selected``
    row of its metrics (else the last validation), cut to k draft positions."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line]
    chosen = [r for r in rows if r.get("split") == "selected"] or [
        r for r in rows if r.get("split") == "val"
    ]
    if not chosen or "acceptance_per_position" not in chosen[-1]:
        return None
    row = chosen[-1]
    rates = row["acceptance_per_position"][:k]
    return {
        "step": row["step"],
        "acceptance_rate_per_position": rates,
        "mean_acceptance_length": 1 + sum(rates) if len(rates) == k else None,
    }


def child_context(use_gpus: bool):
    """How each engine's process starts. On GPUs: spawned, a fresh interpreter whose exit frees
    its devices. On the CPU: forked from a server process that imported vLLM once (seconds per
    engine otherwise), and that has started no engine, thread or device itself."""
    if use_gpus:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm", __name__])
    return ctx


def run_in_child(job: dict[str, Any], scratch: Path, name: str) -> dict[str, Any]:
    out = scratch / f"{name}.json"
    proc = child_context(job["use_gpus"]).Process(target=run_engine, args=(job, str(out)))
    log.info("evaluate: starting engine '%s'", name)
    start = time.perf_counter()
    proc.start()
    while proc.is_alive() and not out.exists():
        proc.join(timeout=1.0)
    # its results written, the engine process gets a while to stop, then is stopped
    proc.join(timeout=CHILD_EXIT_S)
    if proc.is_alive():
        log.warning("evaluate: engine '%s' did not exit after its results; stopping it", name)
        proc.kill()
        proc.join()
    elif proc.exitcode != 0 or not out.exists():
        raise UserError(
            f"vLLM engine '{name}' failed (exit code {proc.exitcode}); see the log above"
        )
    log.info("evaluate: engine '%s' done in %.0f s", name, time.perf_counter() - start)
    return json.loads(out.read_text())
