"""The draft's decoder layer, stated from the verifier's config rather than copied from it.

The draft's decoder layer (``transformer_layer_config`` in its checkpoint, what vLLM builds it
from; ``num_hidden_layers`` of them, ``train.num_draft_layers``): a Llama layer, or with
``train.draft_layer: qwen3`` a Qwen3 layer (the Llama layer plus an RMSNorm over each query and
key head before RoPE, ``q_norm`` and ``k_norm``; vLLM serves it as ``Eagle3Qwen3ForCausalLM``).
From the verifier it takes its width (hidden size, MLP width, attention heads and key/value
heads), its norm epsilon, vocabulary and positions; the rest is chosen here and written explicitly:

* ``head_dim``: the verifier's where its config has one, else hidden_size / num_attention_heads;
  for MLA verifiers (DeepSeek-V3, Kimi-K2) always the latter: their queries and keys are
  qk_nope_head_dim + qk_rope_head_dim wide and their values v_head_dim (a head_dim in their
  config is the rope width), and the draft's Llama attention takes the usual split of the hidden
  size. (``train.draft_attention: mla`` builds an MLA draft with the verifier's MLA shape.)
* RoPE, one flat ``rope_parameters`` (transformers' form, which vLLM's ``get_rope`` reads):
  the verifier's rope theta and scaling (default, linear, dynamic, yarn, llama3, longrope, ...),
  read from ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling``. Where they are
  keyed by layer type (Gemma3: ``full_attention`` and ``sliding_attention``), the full-attention
  layers': the draft attends to the whole prefix. Partial rotary (GLM, Phi:
  ``partial_rotary_factor``) is not copied: the draft rotates its whole head, as Llama does;
  it has positions of its own to encode, not the verifier's heads to match.
"""

from __future__ import annotations

from typing import Any

# transformers' generic config fields, meaningless for one draft layer
GENERIC_CONFIG_KEYS = (
    "id2label",
    "label2id",
    "_name_or_path",
    "transformers_version",
    "dtype",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
    "pretraining_tp",
    "use_cache",
)
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
LAYER_TYPE_KEYS = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")


def rope_parameters(vcfg: dict[str, Any]) -> dict[str, Any]:
    """The verifier's RoPE as one flat ``rope_parameters`` for the draft (module docstring)."""
    params = vcfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # keyed by layer type: the full-attention layers' (else the first kind listed)
        params = params.get("full_attention") or next(iter(params.values()))
    if not isinstance(params, dict) or not params:
        params = dict(vcfg.get("rope_scaling") or {})
        if "rope_theta" in vcfg:
            params["rope_theta"] = vcfg["rope_theta"]
    params = {k: v for k, v in params.items() if v is not None}
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    out = {"rope_type": rope_type, "rope_theta": float(params.pop("rope_theta", 10000.0))}
    if rope_type != "default":
        out.update(params)
    out.pop("partial_rotary_factor", None)
    return out


def head_dim(vcfg: dict[str, Any]) -> int:
    """The verifier's head_dim, else hidden_size / num_attention_heads; for MLA verifiers always
    the latter (transformers writes their rope width, qk_rope_head_dim, as head_dim)."""
    hd = vcfg.get("head_dim")
    if isinstance(hd, int) and hd > 0 and not vcfg.get("kv_lora_rank"):
        return hd
    return int(vcfg["hidden_size"]) // int(vcfg["num_attention_heads"])


DRAFT_LAYERS = ("llama", "qwen3")


def draft_layer_config(verifier_cfg: dict[str, Any], layer: str = "llama") -> dict[str, Any]:
    """The draft's decoder layer as a one-layer config of ``layer`` (llama or qwen3, in
    transformers' dict form): what the checkpoint stores as ``transformer_layer_config`` and what
    the draft is built from."""
    from transformers import LlamaConfig, Qwen3Config

    kwargs = {k: verifier_cfg[k] for k in SHAPE_KEYS if verifier_cfg.get(k) is not None}
    kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
    common = dict(
        head_dim=head_dim(verifier_cfg),
        rope_parameters=rope_parameters(verifier_cfg),
        num_hidden_layers=1,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
    )
    if layer == "llama":
        cfg = LlamaConfig(**kwargs, **common, mlp_bias=False)
        cfg.architectures = ["LlamaForCausalLM"]
    elif layer == "qwen3":  # every layer full attention (layer_types), no sliding window
        cfg = Qwen3Config(**kwargs, **common, use_sliding_window=False, sliding_window=None)
        cfg.architectures = ["Qwen3ForCausalLM"]
    else:
        raise ValueError(f"unknown draft layer {layer!r}; one of {', '.join(DRAFT_LAYERS)}")
    out = cfg.to_dict()
    for generic in GENERIC_CONFIG_KEYS:
        out.pop(generic, None)
    return out


def stacked(
    layer_config: dict[str, Any], num_layers: int, sliding_window: int | None = None
) -> dict[str, Any]:
    """``layer_config`` for ``num_layers`` such layers; with ``sliding_window``, that window in
    every layer, as vLLM reads it: ``layer_types`` (sliding_attention) and ``sliding_window``."""
    out = {**layer_config, "num_hidden_layers": num_layers}
    kind = "full_attention"
    if sliding_window is not None:
        kind = "sliding_attention"
        out["sliding_window"] = sliding_window
        if "use_sliding_window" in out:  # Qwen3's, for transformers' reading
            out["use_sliding_window"] = True
    if "layer_types" in out or sliding_window is not None:  # one per layer
        out["layer_types"] = [kind] * num_layers
    return out


def llama_layer_config(verifier_cfg: dict[str, Any]) -> dict[str, Any]:
    """The draft's decoder layer as a one-layer Llama config (``draft_layer_config``)."""
    return draft_layer_config(verifier_cfg, "llama")
