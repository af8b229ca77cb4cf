"""The MLA draft's attention (``train.draft_attention: mla``): DeepSeek-V2/V3's multi-head latent
attention with the verifier's MLA shape, as vLLM serves EAGLE-3 drafts for the DeepSeek/Kimi
family (``Eagle3DeepseekV2ForCausalLM``: a smaller KV cache than a Llama layer's, and the same
attention backend as the verifier's). Its input is the draft layer's [2H] (embedding and
features side by side):

    q       = q_b_proj(q_a_layernorm(q_a_proj(x)))     (low-rank always: mla_layer_config)
              [heads, qk_nope_head_dim + qk_rope_head_dim], the rope part rotated
    c, k_pe = kv_a_proj_with_mqa(x)                     [kv_lora_rank], [qk_rope_head_dim]
    k_nope, v = kv_b_proj(kv_a_layernorm(c))            [heads, qk_nope_head_dim], [heads, v_head_dim]
    k       = [k_nope, rotated k_pe (one, shared by every head)]
    out     = o_proj(softmax(q . k * scale) v),  scale = (qk_nope + qk_rope)^-1/2 * mscale^2

RoPE as vLLM's DeepSeek attention applies it: on the qk_rope_head_dim part only, pairs of
adjacent values rotated (GPT-J style, ``is_neox_style=False``), with DeepSeek's YaRN where the
verifier scales its positions (``deepseek_yarn``: the cos and sin times mscale / mscale_all_dim,
the attention scale times yarn_mscale(factor, mscale_all_dim) squared).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from workflow_scripts.lib.draft.attention import ttt_attention
from workflow_scripts.lib.draft.layer_config import rope_parameters
from workflow_scripts.lib.draft.layers import RMSNorm

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class MLARotary(nn.Module):
    """cos and sin [n, qk_rope_head_dim / 2] for the rotated pairs (and the attention scale's
    YaRN factor), from the draft's rope parameters."""

    def __init__(self, rope_dim: int, params: dict[str, Any]):
        super().__init__()
        base = float(params.get("rope_theta", 10000.0))
        exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
        pos_freqs = base**exponents
        self.cos_scale, self.attention_mscale = 1.0, 1.0
        if params.get("rope_type", "default") in ("yarn", "deepseek_yarn"):
            factor = float(params["factor"])
            original = int(params["original_max_position_embeddings"])
            beta_fast, beta_slow = float(params.get("beta_fast", 32)), float(
                params.get("beta_slow", 1)
            )

            def correction_dim(rotations: float) -> float:
                return (rope_dim * math.log(original / (rotations * 2 * math.pi))) / (
                    2 * math.log(base)
                )

            low = max(math.floor(correction_dim(beta_fast)), 0)
            high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
            if low == high:
                high += 0.001
            ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(
                0, 1
            )
            extrapolation = 1.0 - ramp
            inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
                1.0 / pos_freqs
            ) * extrapolation
            mscale, mscale_all = float(params.get("mscale", 1)), float(
                params.get("mscale_all_dim", 0)
            )
            self.cos_scale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            self.attention_mscale = yarn_mscale(factor, mscale_all)
        else:
            inv_freq = 1.0 / pos_freqs
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.cos_scale, freqs.sin() * self.cos_scale


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, d] with the pairs (x0, x1), (x2, x3), ... rotated by cos, sin [n, d / 2]."""
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


class MLAAttention(nn.Module):
    """The draft layer's attention as MLA (names as vLLM's checkpoint loader reads them)."""

    def __init__(self, cfg, mla: dict[str, Any], attention_mscale: float):
        super().__init__()
        width, H, heads = 2 * cfg.hidden_size, cfg.hidden_size, cfg.num_attention_heads
        self.heads = heads
        self.nope, self.rope = int(mla["qk_nope_head_dim"]), int(mla["qk_rope_head_dim"])
        self.v_dim, self.kv_rank = int(mla["v_head_dim"]), int(mla["kv_lora_rank"])
        q_rank = int(mla["q_lora_rank"])  # always low-rank, as vLLM loads it (mla_layer_config)
        qk = self.nope + self.rope
        self.q_a_proj = nn.Linear(width, q_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(q_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, H, bias=False)
        self.scale = qk**-0.5 * attention_mscale**2

    def forward(self, x, cos, sin, cache):
        """x: [B, n, 2H]; as ``model.Attention``: this step's (k, v) appended to
        ``cache``, the queries attending to the step-0 keys causally and to their own
        position's keys of later steps. The values are zero-padded to the keys' width (the
        fused kernels take one width), and cut back after."""
        B, n, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, n, self.heads, self.nope + self.rope).transpose(1, 2)
        q = torch.cat([q[..., : self.nope], apply_rope_pairs(q[..., self.nope :], cos, sin)], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, n, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k_pe = apply_rope_pairs(k_pe[:, None], cos, sin).expand(B, self.heads, n, self.rope)
        k = torch.cat([k_nope, k_pe], dim=-1)
        v = nn.functional.pad(v, (0, self.nope + self.rope - self.v_dim))
        cache.append((k, v))
        out = ttt_attention(q, cache, self.scale)[..., : self.v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, n, self.heads * self.v_dim))


def mla_layer_config(vcfg: dict[str, Any], llama_layer: dict[str, Any]) -> dict[str, Any]:
    """The MLA draft's layer: the Llama layer's width, norms and vocabulary (``llama_layer``),
    the verifier's MLA shape, and its rope parameters with their scaling. The query is always
    low-rank: vLLM (0.32) loads an MLA EAGLE-3 draft's query only as ``q_a_proj``/``q_b_proj``
    (it fuses ``q_a_proj`` with ``kv_a_proj_with_mqa``), so for a verifier without a
    ``q_lora_rank`` (DeepSeek-V2-Lite) the draft's is its hidden size, a full-rank query."""
    return {
        **{k: llama_layer[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "rms_norm_eps", "max_position_embeddings", "vocab_size")},
        "num_key_value_heads": llama_layer["num_attention_heads"],
        **{k: vcfg.get(k) for k in MLA_KEYS},
        "q_lora_rank": vcfg.get("q_lora_rank") or llama_layer["hidden_size"],
        "rope_parameters": rope_parameters(vcfg),
    }  # fmt: skip
