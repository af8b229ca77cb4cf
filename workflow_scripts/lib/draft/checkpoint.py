"""Draft checkpoints in the speculators format, which vLLM serves with
``speculative_config={"method": "eagle3", "model": <dir>, "num_speculative_tokens": k}``.

    <dir>/config.json        speculators_model_type "eagle3", architectures ["Eagle3Speculator"],
                             the draft's Llama layer (transformer_layer_config), the auxiliary
                             layer ids in vLLM's convention, the verifier it was trained for
    <dir>/model.safetensors  embed_tokens.weight [V, H], fc.weight [H, mH], input_norm.weight
                             [mH] (with norm_before_fc), fc_norm.{0..m-1}.weight [H] (with
                             fc_norm), layers.0.*,
                             norm.weight, lm_head.weight [K, H], d2t int64 [K] and t2d bool [V]
                             (only when K < V)

vLLM reads ``d2t`` (target id = i + d2t[i]) and skips ``t2d``; both are written so the checkpoint
is also complete for the speculators library. The embedding is the verifier's, as the draft was
trained with it (frozen): vLLM shares the verifier's embedding with a draft only without pipeline
parallelism, and leaves a draft's own uninitialised otherwise, so it is always written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def speculators_config(
    *,
    layer_config: dict[str, Any],
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    num_speculative_tokens: int,
    verifier_name_or_path: str,
    verifier_architectures: list[str] | None,
    norm_before_residual: bool = True,
    norm_before_fc: bool = False,
    norm_output: bool = False,
    fc_norm: bool = False,
    dtype: str = "float32",
) -> dict[str, Any]:
    """config.json of a draft. ``aux_layer_ids`` are in vLLM's convention (id k = input of
    decoder layer k) and listed ascending: the order vLLM concatenates the states in."""
    if sorted(set(aux_layer_ids)) != list(aux_layer_ids):
        raise ValueError(f"aux_layer_ids must be distinct and ascending, got {aux_layer_ids}")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": int(draft_vocab_size),
        "target_hidden_size": int(layer_config["hidden_size"]),
        "norm_before_residual": bool(norm_before_residual),
        "norm_before_fc": bool(norm_before_fc),
        "norm_output": bool(norm_output),
        "fc_norm": bool(fc_norm),
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
        "transformer_layer_config": {**layer_config, "dtype": dtype},
        "torch_dtype": dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_speculative_tokens),
                }
            ],
            "verifier": {
                "name_or_path": str(verifier_name_or_path),
                "architectures": list(verifier_architectures or []),
            },
        },
    }


def mla_draft_config(
    *,
    layer_config: dict[str, Any],
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    num_speculative_tokens: int,
    verifier_name_or_path: str,
    verifier_architectures: list[str] | None,
    norm_before_residual: bool = True,
    norm_output: bool = False,
    dtype: str = "float32",
) -> dict[str, Any]:
    """config.json of an MLA draft (``train.draft_attention: mla``), in the layout vLLM serves as
    ``Eagle3DeepseekV2ForCausalLM`` (a DeepSeek-V2 config of one dense layer: its speculators
    format maps only Llama and Qwen3 layers; model_type ``deepseek_v2``, since vLLM turns every
    draft config of model_type ``deepseek_v3`` into DeepSeek's MTP layer, which an EAGLE-3
    draft is not). Tensors as the speculators format's, the
    attention's as DeepSeek's: ``layers.0.self_attn.{q_a_proj, q_a_layernorm, q_b_proj}``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``."""
    if sorted(set(aux_layer_ids)) != list(aux_layer_ids):
        raise ValueError(f"aux_layer_ids must be distinct and ascending, got {aux_layer_ids}")
    ids = [int(i) for i in aux_layer_ids]
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **layer_config,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "first_k_dense_replace": 1,  # no MoE: vLLM's EAGLE-3 DeepSeek layer is always dense
        "tie_word_embeddings": False,
        "draft_vocab_size": int(draft_vocab_size),
        "target_hidden_size": int(layer_config["hidden_size"]),
        "num_aux_hidden_states": len(ids),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
        "norm_before_residual": bool(norm_before_residual),
        "norm_output": bool(norm_output),
        "fc_norm": False,
        "num_speculative_tokens": int(num_speculative_tokens),
        "verifier": {
            "name_or_path": str(verifier_name_or_path),
            "architectures": list(verifier_architectures or []),
        },
        "torch_dtype": dtype,
    }


def write_draft_checkpoint(
    directory: Path | str,
    weights: dict[str, torch.Tensor],
    config: dict[str, Any],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
) -> None:
    """Write ``directory`` atomically: built under a temporary sibling name, then renamed into
    place (an existing checkpoint there is replaced only once the new one is complete)."""
    directory = Path(directory)
    dtype = DTYPES[config["torch_dtype"]]
    draft_vocab_size = int(config["draft_vocab_size"])
    if d2t.shape != (draft_vocab_size,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},)")
    lm_head = weights["lm_head.weight"]
    if lm_head.shape[0] != draft_vocab_size:
        raise ValueError(f"lm_head has {lm_head.shape[0]} rows, draft vocab is {draft_vocab_size}")
    if "embed_tokens.weight" not in weights:
        raise ValueError("the draft's weights lack embed_tokens.weight (the verifier's embedding)")
    tensors = {
        name: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
        for name, t in weights.items()
    }
    if draft_vocab_size < t2d.numel():
        tensors["d2t"] = d2t.to(torch.int64).cpu().contiguous()
        tensors["t2d"] = t2d.to(torch.bool).cpu().contiguous()
    # else: the full vocabulary; vLLM has no id map then and would refuse a d2t tensor

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # safetensors creates its file readable by the owner only
            f.chmod(0o666 & ~umask)
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def read_draft_checkpoint(directory: Path | str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    return config, load_file(str(directory / "model.safetensors"))
