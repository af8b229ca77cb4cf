"""The draft's building blocks shared by its attention variants: RMSNorm and rotary position
embeddings (RoPE), computed as the serving engine computes them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = at_least_float32(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(layer_config: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """RoPE frequencies and cos/sin scale for the layer config (Llama-3 and other scalings via
    transformers' implementations, so the draft rotates as its serving engine does)."""
    params = layer_config.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", layer_config.get("rope_theta", 10000.0))
        dim = layer_config["head_dim"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return inv_freq.float(), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](LlamaConfig(**layer_config), "cpu")
    return inv_freq.float(), float(scale)


class Rotary(nn.Module):
    def __init__(self, layer_config: dict[str, Any]):
        super().__init__()
        inv_freq, self.scale = rope_inverse_frequencies(layer_config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [len(positions), head_dim] (float32)."""
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scale, emb.sin() * self.scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, n, head_dim] rotated in the 'rotate half' (neox) layout Llama uses."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (at_least_float32(x) * cos + at_least_float32(rotated) * sin).to(x.dtype)
