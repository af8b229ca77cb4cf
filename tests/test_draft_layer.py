"""The draft's decoder layer stated from the verifier's config (lib/draft/layer_config.py): the
shape and RoPE written explicitly for every family, and the draft rotating as vLLM's own rotary
embedding rotates for the same config (what serves the draft)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    Qwen3Config,
)

from workflow_scripts.lib.draft.layer_config import llama_layer_config
from workflow_scripts.lib.draft.model import Rotary, apply_rope

SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
YARN = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
VERIFIERS = {
    "llama": LlamaConfig(**SMALL).to_dict(),
    "llama3.1 (llama3 scaling)": LlamaConfig(
        **SMALL, rope_parameters={**LLAMA3, "rope_theta": 500000.0}, max_position_embeddings=131072
    ).to_dict(),
    # a config.json as older transformers write it: rope_theta and rope_scaling
    "llama3.1, older config.json": {
        **SMALL,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3,
        "max_position_embeddings": 131072,
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
    },
    "qwen3": Qwen3Config(**SMALL, head_dim=64).to_dict(),
    "gemma3 (per layer type)": Gemma3TextConfig(**SMALL, head_dim=64).to_dict(),
    "deepseek-v3 (MLA, yarn)": {
        **DeepseekV3Config(**SMALL, kv_lora_rank=512, qk_rope_head_dim=64).to_dict(),
        "rope_parameters": None,
        "rope_scaling": YARN,
        "rope_theta": 50000.0,
    },
    "gpt-oss (yarn)": GptOssConfig(**SMALL, head_dim=64).to_dict(),
    "glm (partial rotary)": {
        **LlamaConfig(**SMALL).to_dict(),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "partial_rotary_factor": 0.5,
    },
}


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_shape_and_rope_are_stated(name):
    vcfg = VERIFIERS[name]
    layer = llama_layer_config(vcfg)
    params = layer["rope_parameters"]
    assert set(params) >= {"rope_type", "rope_theta"} and "partial_rotary_factor" not in params
    assert not any(isinstance(v, dict) for v in params.values()), params  # one flat set
    assert layer["head_dim"] * layer["num_attention_heads"] >= 1 and layer["num_hidden_layers"] == 1
    if name.startswith("deepseek"):
        # MLA: transformers writes the rope width as head_dim; the draft splits the hidden size
        assert layer["head_dim"] == SMALL["hidden_size"] // SMALL["num_attention_heads"]
        assert params["rope_type"] == "yarn" and params["factor"] == 32.0
        assert params["rope_theta"] == 50000.0
    if name.startswith("gemma3"):
        full = vcfg["rope_parameters"]["full_attention"]["rope_theta"]
        assert (
            params["rope_theta"]
            == full
            != vcfg["rope_parameters"]["sliding_attention"]["rope_theta"]
        )
    if "older" in name:
        assert params == {**LLAMA3, "rope_theta": 500000.0}


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_the_draft_rotates_as_vllm_rotates(name):
    """The draft's RoPE (training) against vLLM's get_rope for the layer config the checkpoint
    carries (serving), on positions past the original context where scalings differ."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    layer = llama_layer_config(VERIFIERS[name])
    heads, hd = layer["num_attention_heads"], layer["head_dim"]
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            hd,
            max_position=layer["max_position_embeddings"],
            is_neox_style=True,
            rope_parameters=layer["rope_parameters"],
            dtype=torch.float32,
        )
    positions = torch.cat([torch.arange(64), torch.tensor([4095, 4096, 9000, 30000])])
    positions = positions[positions < layer["max_position_embeddings"]]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), heads, hd, generator=g)
    k = torch.randn(len(positions), heads, hd, generator=g)
    q_vllm, k_vllm = rope.forward_native(positions, q.reshape(len(positions), -1).clone(),
                                         k.reshape(len(positions), -1).clone())  # fmt: skip
    cos, sin = Rotary(layer)(positions)
    ours_q = apply_rope(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    ours_k = apply_rope(k.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    # float32 angles of tens of thousands of radians round differently in the two caches
    tol = dict(atol=3e-3, rtol=1e-3)
    torch.testing.assert_close(ours_q.reshape(len(positions), -1), q_vllm, **tol)
    torch.testing.assert_close(ours_k.reshape(len(positions), -1), k_vllm, **tol)
