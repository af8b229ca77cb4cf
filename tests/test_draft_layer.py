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


def test_the_qwen3_layer_is_stated_and_read_as_vllm_reads_it():
    """train.draft_layer qwen3: a Qwen3 config of the verifier's shape (model_type qwen3, which
    vLLM's speculators loader maps to Eagle3Qwen3ForCausalLM), full attention in every layer,
    and the draft built from it with a query and a key norm per layer."""
    from vllm.transformers_utils.configs.speculators.algos import update_eagle3

    from workflow_scripts.lib.draft.layer_config import draft_layer_config
    from workflow_scripts.lib.draft.model import DraftConfig, Eagle3Draft

    vcfg = LlamaConfig(**SMALL, vocab_size=100).to_dict()
    layer = draft_layer_config(vcfg, "qwen3")
    assert layer["model_type"] == "qwen3" and layer["head_dim"] == 64
    assert layer["layer_types"] == ["full_attention"] and not layer["use_sliding_window"]
    assert layer["rope_parameters"] == draft_layer_config(vcfg, "llama")["rope_parameters"]
    served: dict = dict(layer)
    update_eagle3({"draft_vocab_size": 50}, served)
    assert served["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    cfg = DraftConfig.from_layer_config(layer, 50, num_layers=2)
    assert cfg.qk_norm and cfg.layer_config["layer_types"] == ["full_attention"] * 2
    names = set(Eagle3Draft(cfg).checkpoint_state_dict())
    for i in (0, 1):
        assert {
            f"layers.{i}.self_attn.q_norm.weight",
            f"layers.{i}.self_attn.k_norm.weight",
        } <= names
    llama = DraftConfig.from_layer_config(draft_layer_config(vcfg, "llama"), 50)
    assert not llama.qk_norm and not any("q_norm" in k for k in Eagle3Draft(llama).state_dict())
    with pytest.raises(ValueError, match="unknown draft layer 'mistral'"):
        draft_layer_config(vcfg, "mistral")


@pytest.mark.parametrize("layer_name", ["llama", "qwen3"])
def test_a_sliding_window_is_written_as_vllm_reads_it(layer_name):
    """train.sliding_window_tokens 64 with two layers: the checkpoint's transformer_layer_config
    says layer_types [sliding_attention] x 2 and sliding_window 64, which vLLM's speculators
    loader hands to the draft's config (where its Llama and Qwen3 attention read them per
    layer); transformers reads a Qwen3 layer the same."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from workflow_scripts.lib.draft.checkpoint import speculators_config
    from workflow_scripts.lib.draft.layer_config import draft_layer_config
    from workflow_scripts.lib.draft.model import DraftConfig

    vcfg = LlamaConfig(**SMALL, vocab_size=100).to_dict()
    cfg = DraftConfig.from_layer_config(
        draft_layer_config(vcfg, layer_name), 50, num_layers=2, sliding_window=64
    )
    assert cfg.sliding_window == 64
    written = speculators_config(
        layer_config=cfg.layer_config, draft_vocab_size=50, aux_layer_ids=[1, 2, 3],
        num_speculative_tokens=3, verifier_name_or_path="v", verifier_architectures=None,
    )  # fmt: skip
    served = SpeculatorsConfig(**SpeculatorsConfig.extract_transformers_pre_trained_config(written))
    assert served.layer_types == ["sliding_attention"] * 2
    assert served.sliding_window == 64 and served.num_hidden_layers == 2
    if layer_name == "qwen3":
        read = Qwen3Config(**written["transformer_layer_config"])
        assert read.layer_types == served.layer_types and read.sliding_window == 64
    full = DraftConfig.from_layer_config(draft_layer_config(vcfg, layer_name), 50, num_layers=2)
    assert "sliding_window" not in full.layer_config or not full.layer_config["sliding_window"]
    assert full.layer_config.get("layer_types", ["full_attention"] * 2) == ["full_attention"] * 2


def test_the_qwen3_layers_attention_is_qwen3s():
    """The draft's attention with the query and key norms (TTT step 0: causal over the prefix)
    against transformers' Qwen3Attention given the same weights, 2H inputs and rotation: the
    norms sit where Qwen3's do (per head, before RoPE), which is where vLLM's Qwen3 layer has them.
    """
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from workflow_scripts.lib.draft.layer_config import draft_layer_config
    from workflow_scripts.lib.draft.model import Attention, DraftConfig

    layer = draft_layer_config(Qwen3Config(**SMALL, head_dim=64, vocab_size=100).to_dict(), "qwen3")
    cfg = DraftConfig.from_layer_config(layer, 50)
    torch.manual_seed(0)
    ours = Attention(cfg).double()
    with torch.no_grad():
        ours.q_norm.weight.uniform_(0.5, 1.5)
        ours.k_norm.weight.uniform_(0.5, 1.5)
    # transformers' layer reads hidden_size inputs: give it 2H, and our output projection
    reference = Qwen3Attention(Qwen3Config(**{**layer, "hidden_size": 2 * cfg.hidden_size}), 0)
    reference.config._attn_implementation = "sdpa"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        setattr(reference, name, getattr(ours, name))
    reference.double()
    n = 12
    x = torch.randn(1, n, 2 * cfg.hidden_size, dtype=torch.float64)
    cos, sin = Rotary(layer)(torch.arange(n))
    cos, sin = cos.double(), sin.double()
    with torch.no_grad():
        got = ours(x, cos, sin, [])
        want, _ = reference(x, (cos[None], sin[None]), None, is_causal=True)
    torch.testing.assert_close(got, want)
    with torch.no_grad():  # without the norms it is another attention
        ours.qk_norm = False
        assert not torch.allclose(ours(x, cos, sin, []), want, atol=1e-3)
