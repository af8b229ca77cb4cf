"""What evaluate writes (``<results_dir>/evaluate/results.json``), typed once: each engine's run
(the verifier alone, with the EAGLE-3 draft, with n-gram), the acceptance per set of prompts and by
context length, what training simulated, and the summary. The report, the benchmarks and the
users' scripts read this file. Beside it, what the engines that serve no draft made
(``reference.json``, ``References``): the evaluate_reference rule serves them once for the
prompts and settings, and every draft trained after is held to them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict

from workflow_scripts.lib.workflow.records import MadeBy, Record


class Acceptance(Record):
    """Mean acceptance length and acceptance per draft position, pooled over prompts as vLLM's
    counters pool them, with 95% bootstrap intervals over the prompts (none without drafts)."""

    num_prompts: int
    mean_acceptance_length: float | None = None
    mean_acceptance_length_ci95: list[float] | None = None
    acceptance_rate_per_position: list[float] | None = None
    acceptance_rate_per_position_ci95: list[list[float]] | None = None


class ContextBucket(Record):
    """The acceptance of the verify steps whose drafts followed a context of this length."""

    context_tokens: list[int]
    num_steps: int
    num_prompts: int
    mean_acceptance_length: float | None = None
    mean_acceptance_length_ci95: list[float] | None = None
    acceptance_rate_per_position: list[float] | None = None
    acceptance_rate_per_position_ci95: list[list[float]] | None = None


class RunAcceptance(Acceptance):
    """A speculating run's acceptance on a set of prompts, overall and by context length, and
    its output tokens a verifier pass (lib/evaluation/acceptance.py tokens_per_pass)."""

    by_context: list[ContextBucket]
    tokens_per_verifier_pass: float | None = None


class SpeedPass(Record):
    """One timed pass of a set's prompts (their first turns, greedy) by a warm engine with
    ``concurrency`` requests in flight (lib/evaluation/speed.py), after the same requests served
    untimed (``warmup_s``); the latencies are medians over its requests of vLLM's request
    metrics; ``started_s``: when its first timed request was added, in seconds since the engine
    began to start (after the engine's start and its acceptance pass)."""

    set: str
    started_s: float
    warmup_s: float
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    mean_acceptance_length: float | None
    drafted_tokens_per_s: float | None
    ttft_median_s: float | None
    tpot_median_s: float | None


class Speedup(Record):
    """Output tokens/s with each speculator over the verifier alone's, on a set (or ``all``) at a
    concurrency."""

    set: str
    concurrency: int
    eagle3: float
    ngram: float


class EngineRun(Record):
    """One engine serving every prompt once for the acceptance (its start and this pass are the
    warm-up the speed passes leave out; their seconds recorded): output tokens, vLLM's
    speculative-decoding counters, per prompt how many verify steps accepted 0..k drafts (overall
    and per context bucket); and, greedy, the timed speed passes."""

    engine_start_s: float
    temperature: float
    sampling: dict[str, Any]
    generation_s: float
    output_tokens: int
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    turns_served: int
    later_turns_too_long: int
    mean_acceptance_length: float | None
    # output tokens over the verifier's passes, the steps that did not draft counted too
    tokens_per_verifier_pass: float | None = None
    acceptance_rate_per_position: list[float]
    acceptance_histograms: list[list[int] | None]
    acceptance_histograms_by_context: list[list[list[int] | None]]
    per_prompt: Acceptance | None = None
    by_context: list[ContextBucket] | None = None
    speed: list[SpeedPass] | None = None


class ReferenceRun(EngineRun):
    """A run of an engine that serves no draft (the verifier alone, n-gram), with what it
    generated for each prompt (all its turns), which the draft's greedy outputs are held to."""

    outputs: list[list[int]]


class PromptKey(Record):
    """A prompt as the engines were served it: its set, id and first prompt's token count."""

    set: str
    id: str | int
    prompt_tokens: int


class References(Record):
    """The evaluate_reference rule's output: the runs of the engines without a draft (named as
    in ``EvalResults.runs``), the prompts they served, and the machine they ran on (the speed
    passes of a draft's engine are compared with theirs only on the same kind)."""

    runs: dict[str, ReferenceRun]
    prompts: list[PromptKey]
    device: str
    made_by: MadeBy


class SetResults(Record):
    """A set of prompts: its counts, each speculating run's acceptance on it (a field named by
    the run: ``eagle3``, ``ngram``, ``eagle3@temperature_0.7``, ...) and EAGLE-3 over n-gram."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, RunAcceptance]

    num_prompts: int
    num_turns: int
    eagle3_over_ngram: float | None
    eagle3_over_ngram_per_pass: float | None = None  # in output tokens a verifier pass


class Simulated(Record):
    """What training simulated for the draft on its held-out split, cut to k positions."""

    step: int
    acceptance_rate_per_position: list[float]
    mean_acceptance_length: float | None  # every position an anchor of k drafts
    walked_acceptance_length: float | None = None  # as greedy decoding counts (vLLM's count)


class PromptRef(Record):
    set: str
    id: str | int
    generated_tokens: int


class Summary(Record):
    eagle3_mean_acceptance_length: float | None
    eagle3_mean_acceptance_length_ci95: list[float] | None
    eagle3_simulated_acceptance_length: float | None
    ngram_mean_acceptance_length: float | None
    eagle3_over_ngram: float | None
    # output tokens a verifier pass: n-gram's plain steps, where it found nothing to draft,
    # counted (vLLM's acceptance length counts only the steps that drafted)
    eagle3_tokens_per_verifier_pass: float | None = None
    ngram_tokens_per_verifier_pass: float | None = None
    eagle3_over_ngram_per_pass: float | None = None
    # over all sets at the lowest concurrency of the speed passes (None without them)
    speedup_concurrency: int | None
    eagle3_speedup: float | None
    ngram_speedup: float | None


class EvalResults(Record):
    runs: dict[str, EngineRun]
    simulated: Simulated | None
    verifier: str
    draft: str
    eval_prompts: list[dict[str, Any]]
    num_prompts: int
    prompts: list[PromptRef]
    sets: dict[str, SetResults]
    context_edges_tokens: list[int]
    num_speculative_tokens: int
    max_new_tokens: int
    greedy_mismatches: dict[str, list[str | int]]
    greedy_lossless: bool
    speedups: list[Speedup]
    summary: Summary
    made_by: MadeBy
