"""The draft's attention under training-time test (TTT), linear in the number of TTT steps.

At TTT step k (0-based) the queries of position t see the step-0 keys of positions 0..t (causal)
and, for each earlier step i = 1..k, the key of step i at position t itself (the "diagonal"):
what vLLM's proposer attends to when it drafts token k+1 (see ``model.py``). So

    scores(t) = [q_t . k0_j for j <= t]  +  [q_t . ki_t for i = 1..k]

* The causal part is one fused SDPA call over the step-0 keys (no mask tensor: flash-style kernels
  on GPUs, the fused flash kernel on the CPU; memory linear in the tokens), which also returns
  the log-sum-exp of its scores.
* The k diagonal scores are k dot products per query, computed directly.
* The two are merged exactly by log-sum-exp: a softmax over [lse_causal, s_1, ..., s_k] weighs
  the causal output and the diagonal values.

Grouped key/value heads are never repeated in memory: the fused kernels take them as they are,
and the diagonal terms broadcast each key/value head over its group of query heads. Padding (at
the end of a row) is never seen by a real query, which only looks left and at itself; rows are
separate batch entries.

A sliding window of W tokens (``window``: a query sees the W most recent positions, its own
included, as vLLM serves ``sliding_attention`` layers): the query at index t of step k sits at
position t+k, so it sees the step-0 keys at indices t-(W-k)+1..t and, as long as W > k, every
diagonal key. Where a row is no longer than that span nothing changes (the fused call above);
else the causal part is computed in blocks of queries, each against the keys its band reaches,
recomputed in the backward pass (memory linear in the tokens).

``dense_ttt_attention`` is the reference: the keys of all steps concatenated, attended through an
explicit [n, (k+1)n] mask. It is quadratic in the steps; tests and the benchmark compare with it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("eagle3")


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the equivalence tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def _fused_causal(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention and the log-sum-exp of its scores per query ([B, H, n], float32), from
    the fused kernel of the device. The output carries gradients; the log-sum-exp does not."""
    n = q.shape[2]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
    elif q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True, scale=scale
        )[:2]
    return out, lse[..., :n].to(accumulation_dtype(q))


def causal_attention_with_lse(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, H, n, d], log-sum-exp [B, H, n] float32) of causal attention, both with
    gradients. The fused kernels return the log-sum-exp without one; its gradient
    (d lse_t / d q_t = scale * sum_j p_tj k_j, d lse_t / d k_j = scale * p_tj q_t) comes from a
    second fused call with the keys as values, added as a term whose value is zero."""
    groups = q.shape[1] // k.shape[1]
    try:
        out, lse = _fused_causal(q, k, v, scale)
    except RuntimeError:  # a kernel without grouped heads: repeat them (memory x groups)
        k_rep, v_rep = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out, lse = _fused_causal(q, k_rep, v_rep, scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        keys_seen = F.scaled_dot_product_attention(
            q.detach(), k.detach(), k, is_causal=True, scale=scale, enable_gqa=groups > 1
        )  # sum_j p_tj k_j, with gradients to the keys as values only
        via_q = (q * keys_seen.detach()).sum(-1).to(lse.dtype)
        via_k = (q.detach() * keys_seen).sum(-1).to(lse.dtype)
        lse = lse + scale * ((via_q - via_q.detach()) + (via_k - via_k.detach()))
    return out, lse


def _band_block(q, k, v, start: int, key_start: int, span: int, scale: float):
    """Queries ``q`` [B, KV, g, m, d] at indices start.. against keys ``k``, ``v`` [B, KV, j, d]
    at indices key_start..: each sees the ``span`` keys up to its own index. Returns (output
    [B, KV, g, m, d], log-sum-exp [B, KV, g, m]), in the accumulation dtype."""
    acc = accumulation_dtype(q)
    scores = torch.einsum("bkgtd,bkjd->bkgtj", q.to(acc), k.to(acc)) * scale
    t = torch.arange(start, start + q.shape[3], device=q.device)[:, None]
    j = torch.arange(key_start, key_start + k.shape[2], device=q.device)[None, :]
    scores = scores.masked_fill((j > t) | (j <= t - span), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bkgtj,bkjd->bkgtd", torch.exp(scores - lse.unsqueeze(-1)), v.to(acc))
    return out, lse


def banded_attention_with_lse(q, k, v, scale: float, span: int, block: int = 512):
    """Causal attention in which each query sees the ``span`` most recent keys (its own
    included): (output [B, H, n, d], log-sum-exp [B, H, n] float32), both with gradients. Blocks
    of ``block`` queries, each against the keys its band reaches; the blocks' scores are
    recomputed in the backward pass, so memory stays linear in n."""
    B, H, n, d = q.shape
    KV = k.shape[1]
    grouped = q.view(B, KV, H // KV, n, d)
    outs, lses = [], []
    for start in range(0, n, block):
        end = min(n, start + block)
        key_start = max(0, start - span + 1)
        args = (grouped[:, :, :, start:end], k[:, :, key_start:end], v[:, :, key_start:end])
        if torch.is_grad_enabled():
            out, lse = checkpoint(
                _band_block, *args, start, key_start, span, scale, use_reentrant=False
            )
        else:
            out, lse = _band_block(*args, start, key_start, span, scale)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=3).view(B, H, n, d).to(q.dtype)
    return out, torch.cat(lses, dim=3).view(B, H, n)


def ttt_attention(
    q,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q [B, H, n, d] of the current step; ``cache`` the (k, v) [B, KV, n, d] of steps 0..now;
    ``scale`` of the scores, d^-1/2 by default; ``window``: a sliding window of that many
    tokens (None: none). Returns [B, H, n, d]."""
    B, H, n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    k0, v0 = cache[0]
    span = None if window is None else window - (len(cache) - 1)  # the step-0 keys it sees
    if span is not None and span < 1:
        raise ValueError(f"a sliding window of {window} tokens sees no key at TTT step "
                         f"{len(cache) - 1}: the window must be larger than the TTT steps")  # fmt: skip
    if span is not None and span < n:
        out, lse = banded_attention_with_lse(q, k0, v0, scale, span)
    else:
        out, lse = causal_attention_with_lse(q, k0, v0, scale)
    if len(cache) == 1:
        return out
    KV, acc = k0.shape[1], lse.dtype
    grouped = q.view(B, KV, H // KV, n, d)  # each key/value head serves a group of query heads
    diagonal = [(grouped * k.unsqueeze(2)).sum(-1).to(acc) * scale for k, _ in cache[1:]]
    logits = torch.stack([lse.view(B, KV, H // KV, n), *diagonal])  # [1 + k, B, KV, g, n]
    weights = torch.softmax(logits, dim=0).unsqueeze(-1)
    merged = weights[0] * out.view(B, KV, H // KV, n, d).to(acc)
    for w, (_, v) in zip(weights[1:], cache[1:]):
        merged = merged + w * v.unsqueeze(2).to(acc)
    return merged.view(B, H, n, d).to(q.dtype)


# --------------------------------------------------------------------------- the reference


def ttt_attention_mask(n: int, step: int, device, window: int | None = None) -> torch.Tensor:
    """Which keys a query may see at TTT ``step``: [n, (step+1)*n] bool. Keys are laid out as the
    step-0 keys (causal; with a ``window``, the window - step most recent), then one block per
    later step (only the same index: the diagonal)."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if window is not None:
        causal = causal.triu(-(window - step - 1))
    diagonal = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def dense_ttt_attention(
    q,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The same attention, dense: every step's keys concatenated (repeated over the groups of
    query heads) and an explicit mask. Quadratic in the steps; the reference."""
    n = q.shape[2]
    keys = torch.cat([c[0] for c in cache], dim=2)
    values = torch.cat([c[1] for c in cache], dim=2)
    groups = q.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    mask = ttt_attention_mask(n, len(cache) - 1, q.device, window)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
