"""A trained draft in the layout SGLang and TensorRT-LLM serve (``export_draft``), and what keeps
a draft from being served by them (``serving_problems``), stated once for the dry-run (from the
recipe) and for the export job (from the checkpoint).

Both engines load a flat Hugging Face Llama config with ``draft_vocab_size`` (architecture
``LlamaForCausalLMEagle3``), not the speculators format, and their decoder layer takes the
residual before ``hidden_norm``: ``norm_before_residual: false``, with no switch. The export keeps
every tensor and writes the config both read, with the auxiliary layers in each one's convention:

- vLLM (which serves the export too): top-level ``eagle_aux_hidden_state_layer_ids``, id k the
  input of decoder layer k;
- SGLang: ``eagle_config.eagle_aux_hidden_state_layer_ids`` only, vLLM's ids minus 1 (it adds 1
  and captures the input of that layer);
- TensorRT-LLM: none in the checkpoint; ``eagle3_layers_to_capture`` at serve time, in the
  output-of-layer convention (vLLM's ids minus 1), which ``serve.sh``'s options file sets.

Tensor names: SGLang 0.5.23's ``LlamaForCausalLMEagle3`` takes the speculators format's
``layers.0.*`` (and maps the ``midlayer.*`` of its earlier releases to it), TensorRT-LLM's
``Eagle3ForCausalLM`` ``midlayer.*``; both skip names they do not know without a word, so a layer
under the wrong name loads as random weights. docs/gpu-and-slurm.md cites the loaders' lines.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workflow_scripts.lib.draft.checkpoint import read_draft_checkpoint, write_draft_checkpoint

ENGINES = {"sglang": "SGLang", "trtllm": "TensorRT-LLM"}
SERVE_SCRIPT = "serve.sh"
TRTLLM_OPTIONS = "trtllm_options.yaml"
# Config keys of the speculators format that the flat config does not carry.
SPECULATORS_ONLY = ("transformer_layer_config", "speculators_config", "speculators_model_type")


@dataclass(frozen=True)
class DraftShape:
    """What decides which engines serve a draft."""

    layer: str  # "llama", "qwen3" (query and key norms) or "mla"
    num_layers: int
    aux_layer_ids: tuple[int, ...] | None  # vLLM's convention; None: the default [2, N//2, N-3]
    sliding_window: int | None
    norm_before_residual: bool

    @classmethod
    def of_checkpoint(cls, config: dict[str, Any]) -> DraftShape:
        """The shape of a draft from its config.json (lib/draft/checkpoint.py writes it)."""
        if config.get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]:
            layer, layers = "mla", config
        else:
            layers = config["transformer_layer_config"]
            layer = "qwen3" if layers.get("model_type") == "qwen3" else "llama"
        sliding = "sliding_attention" in (layers.get("layer_types") or ())
        return cls(
            layer=layer,
            num_layers=int(layers.get("num_hidden_layers", 1)),
            aux_layer_ids=tuple(config["eagle_aux_hidden_state_layer_ids"]),
            sliding_window=int(layers["sliding_window"]) if sliding else None,
            norm_before_residual=bool(config.get("norm_before_residual", True)),
        )


def serving_problems(shape: DraftShape, engine: str) -> list[str]:
    """Why ``engine`` (a key of ENGINES) cannot serve a draft of ``shape`` as it was trained;
    empty where it can. vLLM serves every shape this workflow trains."""
    name, found = ENGINES[engine], []
    if shape.layer != "llama":
        key = "train.draft_attention mla" if shape.layer == "mla" else "train.draft_layer qwen3"
        found.append(
            f"{key}: {name} has no EAGLE-3 draft of that layer (vLLM only); set "
            f"{key.split()[0]}: llama"
        )
    if shape.num_layers != 1:
        why = (
            "normalizes a later layer's input with its hidden_norm, where vLLM and this training "
            "use input_layernorm"
            if engine == "sglang"
            else "is exported with one layer only (its later layers are not checked here)"
        )
        found.append(
            f"train.num_draft_layers {shape.num_layers}: {name} {why}; set "
            "train.num_draft_layers: 1"
        )
    if shape.sliding_window is not None:
        found.append(
            f"train.sliding_window_tokens {shape.sliding_window}: {name}'s EAGLE-3 draft attends "
            "to the whole context, farther back than the draft was trained to; set "
            "train.sliding_window_tokens: null"
        )
    if shape.norm_before_residual:
        found.append(
            f"train.norm_before_residual true: {name} takes the residual before hidden_norm "
            "(false), and would serve this draft otherwise than it was trained, without a word; "
            "set train.norm_before_residual: false and train again"
        )
    if engine == "trtllm" and 0 in (shape.aux_layer_ids or ()):  # the default never has 0
        found.append(
            "auxiliary layer 0 (the embeddings): TensorRT-LLM captures layers' outputs, and the "
            "embeddings are none; give extract.aux_layer_ids ids from 1"
        )
    return found


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The flat Llama config both engines (and vLLM) read, from a speculators config."""
    layer = dict(config["transformer_layer_config"])
    rope = dict(layer.get("rope_parameters") or {})
    ids = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]
    flat = {key: v for key, v in config.items() if key not in SPECULATORS_ONLY}
    return {
        **layer,
        **flat,
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        # transformers before 5 (both engines' releases of 2026) read these, not rope_parameters
        "rope_theta": rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
        "rope_scaling": (
            {k: v for k, v in rope.items() if k != "rope_theta"}
            if rope.get("rope_type", "default") != "default"
            else None
        ),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "use_aux_hidden_state": True,
        },
        "norm_before_residual": False,
    }


def tensor_name(name: str, engine: str) -> str:
    """The name ``engine`` loads the speculators format's tensor ``name`` under."""
    if engine == "trtllm" and name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    return name


def serve_files(config: dict[str, Any], engine: str, out_dir: Path) -> dict[str, str]:
    """``serve.sh`` (and TensorRT-LLM's options file): the engine's command for this draft."""
    spec = config["speculators_config"]
    k = int(spec["proposal_methods"][0]["speculative_tokens"])
    verifier = shlex.quote(str(spec["verifier"]["name_or_path"]))
    draft = out_dir.resolve()
    head = (
        f"#!/bin/sh\n# The verifier with this draft proposing {k} tokens per step, greedy chains.\n"
    )
    if engine == "sglang":
        return {
            SERVE_SCRIPT: head + f"exec python -m sglang.launch_server --model-path {verifier} \\\n"
            f"  --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(str(draft))} \\\n"
            f"  --speculative-num-steps {k} --speculative-eagle-topk 1 "
            f'--speculative-num-draft-tokens {k + 1} "$@"\n'
        }
    capture = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    options = (
        "speculative_config:\n"
        "  decoding_type: Eagle3\n"
        f"  max_draft_len: {k}\n"
        f"  speculative_model_dir: {json.dumps(str(draft))}\n"
        f"  eagle3_layers_to_capture: {json.dumps(capture)}  # vLLM's ids minus 1\n"
    )
    return {
        TRTLLM_OPTIONS: options,
        SERVE_SCRIPT: head + f"exec trtllm-serve {verifier} --extra_llm_api_options "
        f'"$(dirname "$0")/{TRTLLM_OPTIONS}" "$@"\n',
    }


def export_draft(draft_dir: Path, out_dir: Path, engine: str) -> list[str]:
    """Write ``draft_dir``'s draft to ``out_dir`` in ``engine``'s layout; the files written. A
    ValueError, saying why, where the engine cannot serve it as trained."""
    config, tensors = read_draft_checkpoint(draft_dir)
    problems = serving_problems(DraftShape.of_checkpoint(config), engine)
    if problems:
        raise ValueError(
            f"{ENGINES[engine]} cannot serve the draft in {draft_dir} as it was trained:\n  "
            + "\n  ".join(problems)
        )
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if d2t is None:  # the full vocabulary: no map, as the draft has none
        vocab = int(config["transformer_layer_config"]["vocab_size"])
        d2t, t2d = torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)
    weights = {tensor_name(name, engine): t for name, t in tensors.items()}
    write_draft_checkpoint(out_dir, weights, hf_config(config), d2t, t2d)
    for name, text in serve_files(config, engine, out_dir).items():
        (out_dir / name).write_text(text)
    (out_dir / SERVE_SCRIPT).chmod(0o755)
    return sorted(p.name for p in out_dir.iterdir())
