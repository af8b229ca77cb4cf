"""The teacher: the verifier's final norm and lm_head, frozen, applied to the verifier's final
hidden states from the shards, computed as the verifier's family computes them (``HeadSpec``):

* the final norm: RMSNorm ``w * x``; Gemma's is ``(1 + w) * x`` (``norm_offset`` 1);
* the logits: ``lm_head(norm(h))``, times ``logit_scale`` where the config has one, divided by
  ``logits_scaling`` (Granite), then soft-capped, ``cap * tanh(logits / cap)``, where the
  config has ``final_logit_softcapping`` (Gemma 2).

A final norm of another kind (Cohere's LayerNorm) is not computed here; the teacher check stops
such a verifier before training (and vLLM serves no EAGLE-3 draft for Cohere's models).

``training/teacher_check.py`` proves on recorded positions that this is the verifier's own choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# positions x draft vocabulary of the logits the loss holds at once (256 MB in float32): at 8k
# tokens and a 32k vocabulary, whole-step logits would take GBs per TTT step
LOSS_CHUNK_ELEMENTS = 1 << 26
OFFSET_NORM_FAMILIES = ("gemma",)  # model_type prefixes whose RMSNorm is (1 + w) * x


@dataclass(frozen=True)
class HeadSpec:
    norm_offset: float = 0.0
    logit_scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, vcfg: dict[str, Any]) -> "HeadSpec":
        """The verifier family's head, from its config.json (the language model's, for
        multimodal wrappers)."""
        model_type = str(vcfg.get("model_type") or "")
        offset = 1.0 if model_type.startswith(OFFSET_NORM_FAMILIES) else 0.0
        scale = float(vcfg.get("logit_scale") or 1.0)
        if vcfg.get("logits_scaling"):
            scale /= float(vcfg["logits_scaling"])
        cap = vcfg.get("final_logit_softcapping")
        return cls(offset, scale, float(cap) if cap else None)


class TeacherHead(nn.Module):
    """The verifier's final norm and lm_head (frozen): the teacher distribution over the K tokens
    of the draft vocabulary (its rows only), and the verifier's argmax over its whole vocabulary
    (what greedy serving accepts), in chunks of positions; ``draft_to_verifier`` maps draft
    token ids to the verifier's."""

    def __init__(
        self,
        norm_weight: torch.Tensor,
        lm_head_rows: torch.Tensor,
        eps: float,
        lm_head: torch.Tensor | None = None,
        draft_to_verifier: torch.Tensor | None = None,
        spec: HeadSpec = HeadSpec(),
    ):
        super().__init__()
        self.eps = eps
        self.spec = spec
        self.register_buffer("norm_weight", norm_weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head_rows", lm_head_rows.detach().clone(), persistent=False)
        full = lm_head if lm_head is not None else lm_head_rows
        self.register_buffer("lm_head", full.detach().clone(), persistent=False)
        ids = draft_to_verifier if draft_to_verifier is not None else torch.arange(len(full))
        self.register_buffer("draft_to_verifier", ids.to(torch.int64), persistent=False)
        in_draft = torch.zeros(len(full), dtype=torch.bool)
        in_draft[ids] = True
        self.register_buffer("in_draft", in_draft, persistent=False)

    def in_draft_vocab(self, verifier_ids: torch.Tensor) -> torch.Tensor:
        """Whether each verifier token id is in the draft vocabulary (False for -1)."""
        return (verifier_ids >= 0) & self.in_draft[verifier_ids.clamp(min=0)]

    def normed(self, final_hidden: torch.Tensor) -> torch.Tensor:
        x = final_hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight.float() + self.spec.norm_offset) * x

    def _logits(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        logits = (x.to(head.dtype) @ head.T).float() * self.spec.logit_scale
        if self.spec.softcap:
            logits = self.spec.softcap * torch.tanh(logits / self.spec.softcap)
        return logits

    @torch.no_grad()
    def log_probs(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """final_hidden: [N, H] (the last layer's output before the final norm) -> [N, K] fp32."""
        return F.log_softmax(self._logits(self.normed(final_hidden), self.lm_head_rows), dim=-1)

    @torch.no_grad()
    def full_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """final_hidden: [N, H] -> [N, V] the verifier's logits over its whole vocabulary."""
        return self._logits(self.normed(final_hidden), self.lm_head)

    @torch.no_grad()
    def verifier_top1(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """final_hidden: [N, H] -> [N] the verifier's argmax over its whole vocabulary."""
        rows = max(1, LOSS_CHUNK_ELEMENTS // self.lm_head.shape[0])
        out = torch.empty(final_hidden.shape[0], dtype=torch.int64, device=final_hidden.device)
        for i in range(0, final_hidden.shape[0], rows):
            out[i : i + rows] = self.full_logits(final_hidden[i : i + rows]).argmax(-1)
        return out
