"""The MLA draft (train.draft_attention: mla, lib/draft/mla.py) against what serves it: its RoPE
against vLLM's DeepSeek rotary embedding (GPT-J pairs, DeepSeek's YaRN), its unrolled training
against token-by-token decoding with a latent KV cache as vLLM decodes, and its checkpoint's
config read by vLLM's own config parser as Eagle3DeepseekV2ForCausalLM."""

from __future__ import annotations

import math

import pytest
import torch

from workflow_scripts.lib.draft.layer_config import llama_layer_config
from workflow_scripts.lib.draft.mla import MLARotary, apply_rope_pairs, mla_layer_config
from workflow_scripts.lib.draft.model import DraftConfig, Eagle3Draft

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def verifier_cfg(q_lora_rank, rope=YARN):
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 50,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2560,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 6,
        "rope_theta": 10000.0,
        "rope_scaling": rope,
    }


@pytest.mark.parametrize("rope", [YARN, None], ids=["deepseek_yarn", "default"])
def test_mla_rope_is_vllms(rope):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    layer = mla_layer_config(verifier_cfg(None, rope), llama_layer_config(verifier_cfg(None, rope)))
    params = dict(layer["rope_parameters"])
    if params["rope_type"] != "default":  # what vLLM's DeepSeek attention asks get_rope for
        params["rope_type"] = "deepseek_yarn"
    with set_current_vllm_config(VllmConfig()):
        ref = get_rope(8, max_position=2560, is_neox_style=False, rope_parameters=params,
                       dtype=torch.float32)  # fmt: skip
    ours = MLARotary(8, layer["rope_parameters"])
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 2000])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(len(positions), 2, 8, generator=g), torch.randn(
        len(positions), 1, 8, generator=g
    )
    q_ref, k_ref = ref.forward_native(positions, q.clone(), k.clone())  # [n, heads, d]
    cos, sin = ours(positions)
    q_ours = apply_rope_pairs(q.transpose(0, 1), cos, sin).transpose(0, 1)
    k_ours = apply_rope_pairs(k.transpose(0, 1), cos, sin).transpose(0, 1)
    torch.testing.assert_close(q_ours, q_ref.reshape(q.shape), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_ours, k_ref.reshape(k.shape), atol=1e-4, rtol=1e-4)
    if rope is not None:  # the attention scale's YaRN factor, as vLLM's MLA attention sets it
        assert ours.attention_mscale == pytest.approx(0.1 * math.log(40.0) + 1.0)


def small_mla_draft(q_lora_rank, seed=0):
    vcfg = verifier_cfg(q_lora_rank)
    layer = mla_layer_config(vcfg, llama_layer_config(vcfg))
    torch.manual_seed(seed)
    model = Eagle3Draft(DraftConfig.from_layer_config(layer, 20, attention="mla"))
    model.reset_parameters(std=0.3)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "eps") and hasattr(module, "weight"):
                module.weight.uniform_(0.5, 1.5)
    return model.eval().double()


@torch.no_grad()
def decode_like_vllm(model, aux, ids, steps):
    """MLA decoding with a cache of latents (c, k_pe) per position, as vLLM's MLA backend keeps
    it: the prefix fed with the verifier's features, then draft token k at position t+k."""
    layer, attn = model.layers[0], model.layers[0].self_attn
    n = ids.numel() - 1
    feats = model.fc(aux[:n].flatten(1))
    H, nope, rope, vd = attn.heads, attn.nope, attn.rope, attn.v_dim

    def token(t):
        return ids[t] if t < ids.numel() else torch.tensor(0)

    def project(tok, g, pos):
        normed = layer.hidden_norm(g)
        x = torch.cat([layer.input_layernorm(model.embed_tokens(tok)), normed])
        cos, sin = model.rotary(torch.tensor([pos]))
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q = q.view(H, nope + rope)
        q = torch.cat([q[:, :nope], apply_rope_pairs(q[:, nope:][:, None], cos, sin)[:, 0]], -1)
        c, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.kv_rank, rope])
        latent = (attn.kv_a_layernorm(c), apply_rope_pairs(k_pe[None], cos, sin)[0])
        return q, latent, normed if layer.norm_before_residual else g

    def attend(q, latents, residual):
        c = torch.stack([lat[0] for lat in latents])
        k_pe = torch.stack([lat[1] for lat in latents])
        kv = attn.kv_b_proj(c).view(len(latents), H, nope + vd)
        heads = []
        for h in range(H):
            k = torch.cat([kv[:, h, :nope], k_pe], -1)
            w = torch.softmax(k @ q[h] * attn.scale, dim=0)
            heads.append(w @ kv[:, h, nope:])
        r = residual + attn.o_proj(torch.cat(heads))
        return r + layer.mlp(layer.post_attention_layernorm(r))

    out = {}
    prefix = [project(token(t + 1), feats[t], t) for t in range(n)]
    for t in range(n):
        latents = [p[1] for p in prefix[: t + 1]]
        out[0, t] = attend(prefix[t][0], latents, prefix[t][2])
        g = out[0, t]
        for k in range(1, steps):
            q, latent, residual = project(token(t + 1 + k), g, t + k)
            latents = latents + [latent]
            out[k, t] = attend(q, latents, residual)
            g = out[k, t]
    return out


def test_the_draft_query_is_low_rank_as_vllm_loads_it():
    """The verifier's q_lora_rank, or (a verifier without one) the hidden size: vLLM loads an
    MLA EAGLE-3 draft's query only as q_a_proj / q_b_proj."""
    assert (
        mla_layer_config(verifier_cfg(12), llama_layer_config(verifier_cfg(12)))["q_lora_rank"]
        == 12
    )
    assert (
        mla_layer_config(verifier_cfg(None), llama_layer_config(verifier_cfg(None)))["q_lora_rank"]
        == 32
    )


def test_mla_unroll_equals_token_by_token_decoding():
    model = small_mla_draft(12)
    torch.manual_seed(1)
    L, steps = 9, 3
    aux = torch.randn(2, L, 3, 32, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, L))
    with torch.no_grad():
        unrolled = model.unroll(aux, ids, steps)
    for b in range(2):
        for (k, t), r in decode_like_vllm(model, aux[b], ids[b], steps).items():
            torch.testing.assert_close(unrolled[k][b, t], r, atol=1e-10, rtol=1e-10)


def test_mla_checkpoint_is_read_by_vllms_config_parser(tmp_path):
    """The MLA draft's checkpoint: config.json as vLLM reads an HF-style EAGLE-3 draft (its
    speculators format has no MLA layer), the tensors under DeepSeek's attention names."""
    from safetensors.torch import load_file
    from vllm.transformers_utils.config import get_config

    from workflow_scripts.lib.draft.checkpoint import mla_draft_config, write_draft_checkpoint

    model = small_mla_draft(12).float()
    layer = {k: v for k, v in model.cfg.layer_config.items() if k != "num_aux_hidden_states"}
    config = mla_draft_config(
        layer_config=layer,
        draft_vocab_size=20,
        aux_layer_ids=[1, 2, 3],
        num_speculative_tokens=3,
        verifier_name_or_path="/v",
        verifier_architectures=["DeepseekV3ForCausalLM"],
    )
    d2t, t2d = torch.zeros(20, dtype=torch.int64), torch.zeros(50, dtype=torch.bool)
    t2d[:20] = True
    write_draft_checkpoint(tmp_path / "draft", model.checkpoint_state_dict(), config, d2t, t2d)
    hf = get_config(str(tmp_path / "draft"), trust_remote_code=False)
    assert hf.architectures == ["Eagle3DeepseekV2ForCausalLM"] and hf.model_type == "deepseek_v2"
    assert (hf.kv_lora_rank, hf.qk_rope_head_dim, hf.q_lora_rank) == (16, 8, 12)
    assert hf.eagle_aux_hidden_state_layer_ids == [1, 2, 3] and hf.draft_vocab_size == 20
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 40.0
    names = set(load_file(str(tmp_path / "draft" / "model.safetensors")))
    for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                 "kv_b_proj", "o_proj"):  # fmt: skip
        assert f"layers.0.self_attn.{name}.weight" in names, name
    assert {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t"} <= names
