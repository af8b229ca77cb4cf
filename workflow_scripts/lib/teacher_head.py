"""The teacher: the verifier's final norm and lm_head, frozen, applied to the verifier's final
hidden states from the shards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# positions x draft vocabulary of the logits the loss holds at once (256 MB in float32): at 8k
# tokens and a 32k vocabulary, whole-step logits would take GBs per TTT step
LOSS_CHUNK_ELEMENTS = 1 << 26


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
    ):
        super().__init__()
        self.eps = eps
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
        return self.norm_weight.float() * x

    @torch.no_grad()
    def log_probs(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """final_hidden: [N, H] (the last layer's output before the final norm) -> [N, K] fp32."""
        x = self.normed(final_hidden).to(self.lm_head_rows.dtype)
        return F.log_softmax((x @ self.lm_head_rows.T).float(), dim=-1)

    @torch.no_grad()
    def verifier_top1(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """final_hidden: [N, H] -> [N] the verifier's argmax over its whole vocabulary."""
        rows = max(1, LOSS_CHUNK_ELEMENTS // self.lm_head.shape[0])
        out = torch.empty(final_hidden.shape[0], dtype=torch.int64, device=final_hidden.device)
        for i in range(0, final_hidden.shape[0], rows):
            x = self.normed(final_hidden[i : i + rows]).to(self.lm_head.dtype)
            out[i : i + rows] = (x @ self.lm_head.T).argmax(-1)
        return out
