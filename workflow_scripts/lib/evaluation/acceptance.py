"""Evaluation, everything but the entry: the held-out prompts, one vLLM engine per speculator
run in a child process of its own (on the CPU forked from a server that imported vLLM once), the
figures read from vLLM's own counters, and per prompt (vLLM's per-request speculative-decoding
metrics) a bootstrap confidence interval over prompts.
"""

from __future__ import annotations

import bisect
import json
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from workflow_scripts.lib.chat.rows import BadRow, Conversation, normalize
from workflow_scripts.lib.common import UserError, write_json
from workflow_scripts.lib.data.files import source_files
from workflow_scripts.lib.data.layouts import prompt_layout, prompt_row
from workflow_scripts.lib.data.readers import iter_rows
from workflow_scripts.lib.evaluation.speed import speed_passes
from workflow_scripts.lib.verifier.engine import close_llm, make_llm
from workflow_scripts.lib.workflow.params_base import ChatTemplateSettings
from workflow_scripts.lib.workflow.records import MetricsRow
from workflow_scripts.lib.workflow.sources import PromptSource

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


def load_prompt_sets(
    sources: list[PromptSource], template, limit: int | None, max_len: int | None = None
) -> list[dict]:
    """The prompts of every set as the verifier is served them (``template``: the ChatTemplate
    with the serving-time arguments), in order: per prompt its set, id, first prompt's token
    ids, and the user turns served after the verifier's own answer to the one before (MT-Bench's
    second turn). Any bad row stops, naming where it is (the prompts are few and must all be
    usable), as does a first prompt that leaves the engine (``max_len``) no room; ``limit``: at
    most this many prompts of each set (a set's own ``rows`` too)."""
    prompts = []
    for i, source in enumerate(sources):
        files = source_files(source.path, f"eval_prompts[{i}].path") if source.path else []
        layout = prompt_layout(source.layout, source.set)
        taken, most = 0, min((n for n in (limit, source.rows) if n), default=None)
        for where, row in iter_rows(source, files):
            try:
                if isinstance(row, BadRow):
                    raise row
                prompt = prompt_row(row, layout)
                turns = prompt.pop("turns", None)
                if turns is not None:
                    prompt["messages"] = [{"role": "user", "content": turns[0]}]
                conv = prompt_conversation(prompt)
                ids = template.prompt_ids(conv.messages, conv.tools)
            except BadRow as exc:
                raise UserError(f"{where}: not a usable prompt: {exc}") from None
            if max_len is not None and len(ids) >= max_len:
                raise UserError(
                    f"{where}: the prompt has {len(ids)} tokens, and the engine must generate "
                    f"at least one within evaluate.max_model_len_tokens ({max_len}): raise it, "
                    f"or take fewer prompts of set '{source.label}' ('rows')"
                )
            prompts.append(
                {
                    "set": source.label,
                    "id": prompt["id"] if prompt["id"] is not None else where,
                    "prompt_token_ids": ids,
                    "messages": conv.messages,
                    "tools": conv.tools,
                    "later_turns": (turns or [])[1:],
                    "max_new_tokens": source.max_new_tokens,  # None: evaluate's
                }
            )
            taken += 1
            if most is not None and taken >= most:
                break
        if not taken:
            raise UserError(f"evaluation set '{source.label}' holds no prompt")
    return prompts


def _counter(metrics, name: str) -> float:
    return float(sum(m.value for m in metrics if m.name == name and hasattr(m, "value")))


def _vector(metrics, name: str) -> list[int]:
    total: list[int] = []
    for m in metrics:
        if m.name == name and hasattr(m, "values"):
            total = [a + b for a, b in zip(total, m.values)] if total else list(m.values)
    return total


def _sum(a: list[int] | None, b: list[int] | None) -> list[int] | None:
    if a is None or b is None:
        return a if b is None else b
    return [x + y for x, y in zip(a, b)]


def serve(
    llm, prompts: list[dict[str, Any]], params, template, max_len: int, edges: list[int]
) -> tuple[list, list, list, dict[str, int]]:
    """Generates every prompt, then each later user turn after the engine's own answer to the
    turn before (rendered by ``template``, needed only when a prompt has later turns); each
    turn at most its set's max_new_tokens, else ``params``'. Returns per prompt the generated
    token ids of all its turns, its speculative-decoding histogram summed over them and the same
    by context-length bucket (``edges``, see ``by_context``), and the turns served and those
    that did not fit the engine (``max_len``: its max model length; such a turn ends its
    conversation)."""
    own = {n: params.clone() for n in {p["max_new_tokens"] for p in prompts} if n}
    for n, one in own.items():
        one.max_tokens = n
    per_prompt = [own.get(p["max_new_tokens"], params) for p in prompts]
    requests = [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts]
    outputs = llm.generate(requests, per_prompt, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    hists = [_histogram(o) for o in outputs]
    contexts = [by_context(o, r["prompt_token_ids"], edges) for o, r in zip(outputs, requests)]
    chats = {i: list(p["messages"]) for i, p in enumerate(prompts) if p["later_turns"]}
    last = {i: list(outputs[i].outputs[0].token_ids) for i in chats}
    turn = too_long = 0
    turns = len(prompts)
    while chats:
        served, ids = [], []
        for i, messages in chats.items():
            tools = prompts[i]["tools"]
            text = template.render(messages, tools, generation_prompt=True)
            messages.append(template.answer_message(text, last[i]))
            messages.append({"role": "user", "content": prompts[i]["later_turns"][turn]})
            prompt = template.prompt_ids(messages, tools)
            if len(prompt) >= max_len:  # no room to generate: the conversation ends here
                too_long += 1
                continue
            served.append(i)
            ids.append({"prompt_token_ids": prompt})
        generated = llm.generate(ids, [per_prompt[i] for i in served], use_tqdm=False)
        for i, out, request in zip(served, generated, ids):
            last[i] = list(out.outputs[0].token_ids)
            tokens[i] += last[i]
            hists[i] = _sum(hists[i], _histogram(out))
            more = by_context(out, request["prompt_token_ids"], edges)
            contexts[i] = [_sum(a, b) for a, b in zip(contexts[i], more)]
        turn += 1
        turns += len(served)
        chats = {i: chats[i] for i in served if len(prompts[i]["later_turns"]) > turn}
    return tokens, hists, contexts, {"turns_served": turns, "later_turns_too_long": too_long}


def _histogram(output) -> list[int] | None:
    metrics = output.outputs[0].spec_decode_metrics
    return list(metrics.histogram) if metrics else None


def by_context(output, prompt_ids: list[int], edges: list[int]) -> list[list[int] | None]:
    """One request's verify steps by the context length at their first drafted position, as
    histograms (how many steps accepted j = 0..k drafts), one per bucket: bucket b holds the
    contexts below ``edges[b]`` and at or above the edge before (the last, every longer one).
    The context at a step is the prompt, the token sampled at prefill (the drafts of the first
    step follow it) and every token the steps before it gave (the accepted drafts and the
    verifier's own token). From vLLM's per-step record (per_request_spec_decode_metrics:
    detailed); None for every bucket without speculative decoding."""
    metrics = output.outputs[0].spec_decode_metrics
    if not metrics:
        return [None] * len(edges)
    if len(metrics.per_step_accepted) != sum(metrics.histogram):
        raise RuntimeError(
            f"vLLM recorded {len(metrics.per_step_accepted)} verify steps one by one and "
            f"{sum(metrics.histogram)} in its histogram: the engine must be made with "
            "per_request_spec_decode_metrics='detailed'"
        )
    hists = [[0] * len(metrics.histogram) for _ in edges]
    context = len(prompt_ids) + 1
    for accepted in metrics.per_step_accepted:
        bucket = min(bisect.bisect_right(edges, context), len(edges) - 1)
        hists[bucket][accepted] += 1
        context += accepted + 1
    return hists


def sampling_settings(llm) -> dict[str, Any]:
    """What the engine's speculative decoding samples with, as the installed vLLM states it."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    spec = getattr(config, "speculative_config", None)
    if spec is None:
        return {}
    names = ("method", "num_speculative_tokens", "draft_sample_method", "rejection_sample_method")
    return {n: getattr(spec, n) for n in names if getattr(spec, n, None) is not None}


def run_engine(job: dict[str, Any], out_path: str) -> None:
    """One engine, one configuration, in a child process; results to ``out_path`` (JSON). A
    failure ends the process at once, its traceback logged: a normal exit would wait on the
    engine's workers, and the parent with it."""
    try:
        _run_engine(job, out_path)
    except BaseException:
        log.exception("evaluate: the engine's run failed")
        logging.shutdown()
        os._exit(1)


def _run_engine(job: dict[str, Any], out_path: str) -> None:
    from vllm import SamplingParams

    from workflow_scripts.lib.chat.template import load_template

    # one CPU worker: the engine core runs in this process (see engine.make_llm)
    started = time.perf_counter()
    llm = make_llm(job["engine"], use_gpus=job["use_gpus"])
    engine_start_s = time.perf_counter() - started
    template = None
    if any(p["later_turns"] for p in job["prompts"]):
        template = load_template(job["verifier"], ChatTemplateSettings(**job["chat_template"]))
    # one short request first: the acceptance pass then starts with the engine's first steps done
    first = [{"prompt_token_ids": job["prompts"][0]["prompt_token_ids"]}]
    llm.generate(first, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    before = llm.get_metrics()
    results = {}
    for name, temperature in job["runs"]:
        params = SamplingParams(
            max_tokens=job["max_new_tokens"], temperature=temperature, seed=job["seed"]
        )
        start = time.perf_counter()
        outputs, histograms, contexts, turns = serve(
            llm, job["prompts"], params, template, job["max_model_len"], job["context_edges"]
        )
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
        out_tokens = sum(len(o) for o in outputs)
        results[name] = {
            "engine_start_s": engine_start_s,
            "temperature": temperature,
            "sampling": {"seed": job["seed"], **sampling_settings(llm)},
            "generation_s": elapsed,
            "output_tokens": out_tokens,
            "num_drafts": drafts,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            **turns,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "tokens_per_verifier_pass": tokens_per_pass(out_tokens, accepted),
            "acceptance_rate_per_position": [a / drafts for a in per_pos] if drafts else [],
            # per prompt (its turns together): how many verify steps accepted j = 0..k drafts
            "acceptance_histograms": histograms,
            # the same per prompt and context-length bucket (job["context_edges"])
            "acceptance_histograms_by_context": contexts,
            "outputs": outputs,
        }
    # the speed passes, greedy, the engine warm: its start and the passes above left out
    results["greedy"]["speed"] = speed_passes(
        llm,
        job["prompts"],
        job["max_new_tokens"],
        job["concurrency"],
        job["speed_pass_min_s"],
        started,
    )
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


def acceptance_by_context(
    histograms: list[list[list[int] | None]], edges: list[int]
) -> list[dict[str, Any]]:
    """Per context-length bucket (``edges``: where each ends), the acceptance of the verify
    steps whose drafts followed a context of that length, with its interval over the prompts
    that reached it (``acceptance_with_ci``); ``histograms``: per prompt, per bucket."""
    buckets = []
    for b, end in enumerate(edges):
        rows = [h[b] for h in histograms]
        entry = {"context_tokens": [edges[b - 1] if b else 0, end]}
        entry["num_steps"] = int(sum(sum(h) for h in rows if h))
        buckets.append({**entry, **acceptance_with_ci(rows)})
    return buckets


def tokens_per_pass(output_tokens: float, accepted: float) -> float | None:
    """Output tokens per forward pass of the verifier that emits tokens (a prompt's prefill, a
    decoding or verify step), each of which emits the verifier's own token and the drafts it
    accepted. vLLM's acceptance length (1 + accepted / drafts) counts only the steps that
    drafted: n-gram drafts only where the text so far holds a match, and its plain steps count
    here; for a draft that drafts at every step the two agree. A request that ends within a
    step's accepted drafts leaves a few counted and not output (0.3% on the real model)."""
    passes = output_tokens - accepted
    return output_tokens / passes if output_tokens and passes > 0 else None


def per_set(
    prompts: list[dict[str, Any]],
    runs: dict[str, Any],
    edges: list[int],
    output_tokens: dict[str, list[int]],
) -> dict[str, Any]:
    """Acceptance of each speculating run on each set of prompts (with its interval over the
    set's prompts), overall and by context length (``edges``: where the buckets end), its
    output tokens a verifier pass (``output_tokens``: per run, each prompt's), and EAGLE-3 over
    n-gram on each, by both."""
    sets: dict[str, Any] = {}
    for name in dict.fromkeys(p["set"] for p in prompts):
        mine = [i for i, p in enumerate(prompts) if p["set"] == name]
        turns = sum(1 + len(prompts[i]["later_turns"]) for i in mine)
        entry: dict[str, Any] = {"num_prompts": len(mine), "num_turns": turns}
        for run, result in runs.items():
            if result["num_drafts"]:
                hists = [result["acceptance_histograms"][i] for i in mine]
                entry[run] = acceptance_with_ci(hists)
                entry[run]["by_context"] = acceptance_by_context(
                    [result["acceptance_histograms_by_context"][i] for i in mine], edges
                )
                accepted = sum(j * n for h in hists if h for j, n in enumerate(h))
                entry[run]["tokens_per_verifier_pass"] = tokens_per_pass(
                    sum(output_tokens[run][i] for i in mine), accepted
                )
        for key, ratio in (
            ("mean_acceptance_length", "eagle3_over_ngram"),
            ("tokens_per_verifier_pass", "eagle3_over_ngram_per_pass"),
        ):
            eagle, ngram = (entry.get(r, {}).get(key) for r in ("eagle3", "ngram"))
            entry[ratio] = eagle / ngram if eagle and ngram else None
        sets[name] = entry
    return sets


def simulated_acceptance(metrics_path: Path, k: int) -> dict[str, Any] | None:
    """What training simulated for the draft it wrote, on its held-out split: the ``selected``
    row of its metrics (else the last validation), cut to k draft positions, and as greedy
    decoding counts it (where training counted it, at the same k)."""
    rows = MetricsRow.read_all(metrics_path)
    chosen = [r for r in rows if r.split == "selected"] or [r for r in rows if r.split == "val"]
    if not chosen:
        return None
    row = chosen[-1]
    rates = row.acceptance_per_position[:k]
    walked = row.walked_acceptance_by_k or []
    return {
        "step": row.step,
        "acceptance_rate_per_position": rates,
        "mean_acceptance_length": 1 + sum(rates) if len(rates) == k else None,
        **({"walked_acceptance_length": walked[k - 1]} if len(walked) >= k else {}),
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
