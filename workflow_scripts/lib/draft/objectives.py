"""What a trained position of the draft adds to the loss: the objective against the teacher
(``train.loss``) and the options on top of it, computed per position by ``objective_value``
from the forward KL and the two distributions (``Eagle3Draft.chunk_loss``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

OBJECTIVES = ("kl", "tv", "lk_alpha", "lk_hybrid")


@dataclass(frozen=True)
class Objective:
    """What a trained position adds to the loss (``train.loss`` and the options on top of it):

    * ``name``: the per-position objective against the teacher (``objective_value``), with
      ``lk_eta`` for lk_hybrid;
    * ``topk_weight`` w and ``topk`` K: plus w x the cross-entropy of the draft over the
      teacher's K most likely tokens, -sum_{v in top-K(p)} p_v log q_v (HASS's top-K
      distillation: the head of the distribution, where the tokens served are, counts more);
    * ``chain``: at TTT step k > 0 only the positions whose draft tokens of steps 0..k-1 were all
      the verifier's argmax (GRIFFIN's token alignment: vLLM's greedy chain never reaches a
      later step past a rejected token, so those positions train nothing it serves).
    """

    name: str = "kl"
    lk_eta: float = 3.0
    topk_weight: float = 0.0
    topk: int = 10
    chain: bool = False


LK_ALPHA_FLOOR = 1e-6  # -log alpha where the distributions barely overlap


def objective_value(objective: str, kl, p, q, lk_eta: float = 3.0) -> torch.Tensor:
    """The per-position loss [c] from the forward KL [c] and the distributions p (teacher) and
    q (draft) [c, K]. alpha = sum min(p, q): speculative sampling's acceptance rate."""
    if objective == "kl":
        return kl
    alpha = torch.minimum(p, q).sum(-1)
    if objective == "tv":
        return 1.0 - alpha
    if objective == "lk_alpha":
        return -torch.log(alpha.clamp_min(LK_ALPHA_FLOOR))
    if objective == "lk_hybrid":
        blend = torch.exp(-lk_eta * alpha.detach())
        return blend * kl + (1.0 - blend) * (1.0 - alpha)
    raise ValueError(f"unknown loss {objective!r}; one of {', '.join(OBJECTIVES)}")
