"""Serving speed as users serve: each engine, already started and through its acceptance pass,
serves each set's prompts again with a fixed number of requests in flight, a new one added as
soon as one finishes, for each concurrency in turn: once untimed, then timed from the first
request added to the last one finished (repeated where that is shorter than evaluate's
``speed_pass_min_s``). Per pass: output tokens/s, the acceptance, and per request vLLM's own
time to first token and time per output token (its request metrics). Then each speculator's
speedup over the verifier alone, per set and concurrency and over all sets: the engines without a
draft are served by another job (evaluate_reference), so a speedup is taken only between jobs on
the same kind of machine (``device_description``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections import deque
from typing import Any


def device_description(use_gpus: bool) -> str:
    """What a job's engines run on, for the speed passes of two jobs to be compared: the GPUs'
    names (NVIDIA's tool, which starts nothing on them) and count, or the CPU's model and the
    cores the job may use."""
    if use_gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        cmd = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        try:
            out = subprocess.run(
                cmd + ([f"--id={visible}"] if visible else []),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            out = ""
        names = [line.strip() for line in out.splitlines() if line.strip()]
        if not names:
            return "GPUs not named (nvidia-smi named none)"
        return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else " + ".join(names)
    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{len(os.sched_getaffinity(0))} cores of {model}"


def speed_pass(
    llm,
    prompts: list[dict[str, Any]],
    max_new_tokens: int,
    concurrency: int,
    min_s: float,
    origin: float,
):
    """One timed pass of ``prompts`` (their first turns, greedy) with ``concurrency`` requests in
    flight: at least that many requests, the prompts repeated in order where there are fewer. The
    same requests are served once untimed first (its seconds: ``warmup_s``), so that what an
    engine does once for a new mix of batch shapes is not timed; then timed, again until the
    timed passes add up to ``min_s`` seconds at least (a window of seconds, not of a few steps).
    Returns the pass's figures (lib/evaluation/records.py: ``SpeedPass``, less its set), with
    when the timed pass started, in seconds since ``origin`` (when the engine began to start)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    requests = [prompts[i % len(prompts)] for i in range(max(len(prompts), concurrency))]
    params = {
        n: SamplingParams(max_tokens=n, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
        for n in {p["max_new_tokens"] or max_new_tokens for p in requests}
    }
    served = [
        (p["prompt_token_ids"], params[p["max_new_tokens"] or max_new_tokens]) for p in requests
    ]
    tag = f"speed-{prompts[0]['set']}-{concurrency}"
    _, warmup = _serve(llm.llm_engine, served, concurrency, f"{tag}-warmup")
    start = time.perf_counter()
    finished, wall = [], 0.0
    while not finished or wall < min_s:
        outputs, seconds = _serve(llm.llm_engine, served, concurrency, f"{tag}-{len(finished)}")
        finished, wall = finished + outputs, wall + seconds
    tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    return {
        "started_s": start - origin,
        "warmup_s": warmup,
        "concurrency": concurrency,
        "requests": len(finished),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        **_drafts(finished, wall),
        **_latencies(finished),
    }


def _serve(engine, served: list[tuple], concurrency: int, tag: str) -> tuple[list, float]:
    """``served`` (prompt token ids, sampling parameters), ``concurrency`` at a time, each new one
    added as soon as one finishes: the finished outputs, and the seconds from the first added to
    the last finished."""
    queue = deque(enumerate(served))
    finished, in_flight = [], 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            i, (ids, params) = queue.popleft()
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                finished.append(out)
                in_flight -= 1
    return finished, time.perf_counter() - start


def _drafts(outputs, wall: float) -> dict[str, float | None]:
    """Over the pass's requests: 1 + accepted drafts per verify step, and draft tokens proposed
    per second (k per verify step); None without drafts."""
    steps = accepted = proposed = 0
    for out in outputs:
        metrics = out.outputs[0].spec_decode_metrics
        if metrics:
            steps += sum(metrics.histogram)
            accepted += sum(j * n for j, n in enumerate(metrics.histogram))
            proposed += sum(metrics.histogram) * (len(metrics.histogram) - 1)
    return {
        "mean_acceptance_length": 1 + accepted / steps if steps else None,
        "drafted_tokens_per_s": proposed / wall if steps else None,
    }


def _latencies(outputs) -> dict[str, float | None]:
    """The median over requests of vLLM's time to first token and time per output token after
    the first (its request metrics; None where the engine keeps none)."""
    ttft, tpot = [], []
    for out in outputs:
        stats = out.metrics
        if stats is None or not stats.first_token_ts:
            continue
        ttft.append(stats.first_token_latency)
        if stats.num_generation_tokens > 1:
            tpot.append(
                (stats.last_token_ts - stats.first_token_ts) / (stats.num_generation_tokens - 1)
            )
    return {
        "ttft_median_s": statistics.median(ttft) if ttft else None,
        "tpot_median_s": statistics.median(tpot) if tpot else None,
    }


def speed_passes(
    llm,
    prompts: list[dict[str, Any]],
    max_new_tokens: int,
    concurrency: list[int],
    min_s: float,
    origin: float,
):
    """Every set's passes, a set's at each concurrency in turn (``speed_pass``)."""
    passes = []
    for name in dict.fromkeys(p["set"] for p in prompts):
        mine = [p for p in prompts if p["set"] == name]
        for c in concurrency:
            passes.append({"set": name, **speed_pass(llm, mine, max_new_tokens, c, min_s, origin)})
    return passes


def speedups(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """Each speculator's output tokens/s over the verifier alone's, per set and concurrency, then
    over all sets (their tokens over their time) at each concurrency: those every engine was
    timed at (evaluate_reference's engines keep the concurrencies they were served with)."""
    mine = {
        name: {(s["set"], s["concurrency"]): s for s in runs[name]["speed"]}
        for name in ("eagle3", "ngram")
    }
    base = {
        (s["set"], s["concurrency"]): s
        for s in runs["baseline"]["speed"]
        if all((s["set"], s["concurrency"]) in passes for passes in mine.values())
    }
    rows = [
        {"set": key[0], "concurrency": key[1]}
        | {name: mine[name][key]["output_tokens_per_s"] / b["output_tokens_per_s"] for name in mine}
        for key, b in base.items()
    ]

    def pooled(passes: dict, c: int) -> float:
        chosen = [s for (_, cc), s in passes.items() if cc == c]
        return sum(s["output_tokens"] for s in chosen) / sum(s["wall_s"] for s in chosen)

    for c in dict.fromkeys(c for _, c in base):
        rows.append(
            {"set": "all", "concurrency": c}
            | {name: pooled(mine[name], c) / pooled(base, c) for name in mine}
        )
    return rows
