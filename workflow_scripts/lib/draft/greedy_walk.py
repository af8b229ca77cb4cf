"""Greedy speculative decoding's count of acceptance over answers whose drafts are known at
every position: training's validation (``Eagle3Draft.forward(walk=True)``) and
benchmarks/bench_copying.py count with it what vLLM counts, where taking every position as an
anchor (training's simulated figure) counts a run of agreement at each of its positions."""

from __future__ import annotations

import torch


def walk_answers(anchored: torch.Tensor, chain: torch.Tensor) -> tuple[int, int]:
    """(verify steps, drafts accepted) of greedy speculative decoding over every answer:
    ``anchored`` [B, n] the anchors (a run of them is one answer turn), ``chain`` [B, n] the
    drafts accepted at each. The answer's first token is the prefill's, so the first step is
    anchored at the run's second position; each next one after the drafts accepted. Where
    agreement comes in runs this counts fewer accepting steps than taking every position as an
    anchor does; over the verifier's own answers it is vLLM's count."""
    steps = accepted = 0
    for row, chains in zip(anchored.tolist(), chain.tolist()):
        t, end = 0, len(row)
        while t < end:
            if not row[t]:
                t += 1
                continue
            stop = t
            while stop < end and row[stop]:
                stop += 1
            t += 1  # the prefill's token
            while t < stop:
                steps, accepted = steps + 1, accepted + chains[t]
                t += chains[t] + 1
            t = max(t, stop)
    return steps, accepted


def walk_steps(anchored: torch.Tensor, alive: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``walk_answers`` at every k: ``alive`` [S] x [B, n] the anchors whose drafts up to step
    j were all accepted; returns (verify steps [S], drafts accepted [S]), k = j + 1 drafts a
    step."""
    counts = [
        walk_answers(anchored, sum(a.long() for a in alive[: k + 1])) for k in range(len(alive))
    ]
    steps, accepted = zip(*counts)
    return torch.tensor(steps, dtype=torch.float64), torch.tensor(accepted, dtype=torch.float64)
