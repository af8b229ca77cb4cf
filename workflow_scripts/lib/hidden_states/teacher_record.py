"""What extraction records for the teacher check (``training/teacher_check.py``): for one sample
of each shard, the verifier's own next-token choice at the positions whose final state the shard
stores, as its engine computes it (vLLM's prompt logprobs, transformers' logits). Training
computes its teacher there before its first step and stops when the two disagree.
"""

from __future__ import annotations

from typing import Any

import torch

CHECK_TOKENS = 1024  # the prefix of the sample whose positions are checked (its logprobs cost)


def choose(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any] | None:
    """The sample of a shard to check, and its prefix: the one with the most positions whose
    final state the shard stores (position p where token p+1 is supervised) in its first
    CHECK_TOKENS tokens. None when no sample has any."""
    best = None
    for k, (ids, mask) in enumerate(samples):
        n = min(int(ids.numel()), CHECK_TOKENS)
        m = mask[1 : n + 1].bool()
        positions = torch.nonzero(m).flatten().tolist()
        if positions and (best is None or len(positions) > len(best["positions"])):
            best = {"sample": k, "tokens": n, "positions": positions}
    return best


def top1_from_vllm(output, check: dict[str, Any]) -> list[int]:
    """The verifier's top-1 at each checked position, from a vLLM request output with
    ``prompt_logprobs`` (position p's choice is the distribution of token p+1) and its one
    greedy token (the choice at the prefix's last position)."""
    top1 = []
    for p in check["positions"]:
        if p + 1 < check["tokens"]:
            dist = output.prompt_logprobs[p + 1]
            top1.append(int(min(dist.items(), key=lambda kv: kv[1].rank)[0]))
        else:
            top1.append(int(output.outputs[0].token_ids[0]))
    return top1
