"""Starting training from an existing draft (``train.init_from``): a draft this workflow trained
(copied out of its results directory), or an EAGLE-3 draft in the speculators format for the same
verifier (a public one, say), fine-tuned on the user's data instead of trained from nothing.

The check (``check_init_draft``) reads the draft's config.json only, so the dry-run runs it in a
fraction of a second: the draft must be of the shape training builds (the verifier's hidden size
and vocabulary, ``train.num_draft_layers`` layers of ``train.draft_layer``, or the MLA layout with
``train.draft_attention: mla``), read the auxiliary layers extraction stores, and have the
EAGLE-3.1 options training has (each mismatch names the setting to change).

The weights (``load_init_weights``) replace the draft as training builds it, tensor by tensor;
the embedding stays the verifier's (frozen). The draft vocabulary may differ from the one the
vocab stage chose: each lm_head row of a token both vocabularies hold is the old draft's, the
others keep their start (the verifier's row). A resumed training state takes precedence: the
start matters only at step 0, and the draft's files are part of what a state must match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier.files import default_aux_layer_ids

MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
LEGACY_PREFIX = ("midlayer.", "layers.0.")  # EAGLE-3's first checkpoints named layer 0 so
NOT_TRAINED = ("embed_tokens.weight", "d2t", "t2d")  # the verifier's embedding; the vocab maps


def weight_files(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("*.safetensors"))


def read_config(directory: Path | str) -> dict[str, Any]:
    """The draft's config.json; a directory without it or without weights is refused."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(
            f"train.init_from {directory}: no config.json there; give the directory of an "
            "EAGLE-3 draft (config.json and model.safetensors, the speculators format)"
        )
    if not weight_files(directory):
        raise UserError(f"train.init_from {directory}: no .safetensors weights beside config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"train.init_from {path}: not JSON ({exc})") from None


def files(directory: Path | str | None, train_dir: Path | None = None) -> list[Path]:
    """What the train rule reads of the draft (its config and weights): a change reruns it.
    The draft is refused where it is missing or inside ``train_dir`` (training's own output)."""
    if directory is None:
        return []
    directory = Path(directory)
    if train_dir is not None and directory.resolve().is_relative_to(Path(train_dir).resolve()):
        raise UserError(
            f"train.init_from {directory} lies in {train_dir}, which training writes: copy the "
            f"draft out first (cp -r {directory} drafts/previous) and name the copy"
        )
    read_config(directory)
    return [directory / "config.json", *weight_files(directory)]


def layer_of(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the draft's layer: llama, qwen3 or mla; its layer config)."""
    if config.get("architectures") == [MLA_ARCHITECTURE]:
        return "mla", config
    layer = config.get("transformer_layer_config")
    if config.get("speculators_model_type") != "eagle3" or not isinstance(layer, dict):
        raise UserError(
            "not an EAGLE-3 draft in the speculators format (speculators_model_type eagle3 and "
            f"a transformer_layer_config) nor this workflow's MLA draft ({MLA_ARCHITECTURE})"
        )
    return str(layer.get("model_type", "llama")), layer


def check_init_draft(
    directory: Path | str, p: Any, vcfg: dict[str, Any], aux_layer_ids: list[int]
) -> None:
    """That the draft in ``directory`` is one training can start from (module docstring): ``p``
    the train settings, ``vcfg`` the verifier's config, ``aux_layer_ids`` extraction's, ascending.
    Raises a UserError listing every mismatch."""
    where = f"train.init_from {directory}"
    config = read_config(directory)
    try:
        layer, shape = layer_of(config)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    problems = []

    def differs(what: str, theirs: Any, ours: Any, fix: str, whose: str = "training's") -> None:
        if theirs != ours:
            problems.append(f"{what}: {theirs!r} where {whose} is {ours!r}; {fix}")

    wanted = "mla" if p.draft_attention == "mla" else p.draft_layer
    differs("its layer", layer, wanted, "set train.draft_layer (llama or qwen3) or "
            "train.draft_attention (mla) to the draft's")  # fmt: skip
    other = "it is a draft of another verifier"
    for key in ("hidden_size", "vocab_size"):
        differs(f"its {key}", shape.get(key), vcfg.get(key), other, "the verifier's")
    if layer != "mla":
        target = config.get("target_hidden_size", shape.get("hidden_size"))
        differs("its target_hidden_size", target, vcfg.get("hidden_size"), other,
                "the verifier's hidden_size")  # fmt: skip
    layers = 1 if layer == "mla" else shape.get("num_hidden_layers")
    differs("its number of layers", layers, p.num_draft_layers, "set train.num_draft_layers")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:  # speculators' default, the one extraction has too
        ids = default_aux_layer_ids(int(vcfg["num_hidden_layers"]))
    differs("its auxiliary layers", sorted(ids), list(aux_layer_ids),
            f"set extract.aux_layer_ids: {sorted(ids)} (its fc layer reads those)",
            "extraction's")  # fmt: skip
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        differs(key, bool(config.get(key, False)), bool(getattr(p, key)), f"set train.{key}")
    residual = bool(config.get("norm_before_residual", True))  # the speculators format's default
    differs(
        "norm_before_residual", residual, p.norm_before_residual, "set train.norm_before_residual"
    )
    theirs = ((config.get("speculators_config") or {}).get("verifier") or {}).get("architectures")
    if theirs and vcfg.get("architectures") and theirs != vcfg["architectures"]:
        problems.append(
            f"it was trained for a {theirs[0]} verifier and the verifier is a "
            f"{vcfg['architectures'][0]}"
        )
    if problems:
        raise UserError(f"{where} cannot start this training:\n  " + "\n  ".join(problems))


def load_init_weights(model, directory: Path | str, d2t) -> str:
    """Copy the draft's weights in ``directory`` into ``model`` (an Eagle3Draft as training
    builds it, already checked by ``check_init_draft``); ``d2t`` the draft vocabulary's map of
    this training. Returns what was taken, for the log."""
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    theirs: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        theirs.update(load_file(str(path)))
    old, new = LEGACY_PREFIX
    theirs = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in theirs.items()}
    ours = model.trainable_state_dict()
    # a frozen tensor a draft may leave out keeps its start (a later layer's hidden_norm: ones)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    missing = sorted(k for k in ours if k not in theirs and k not in frozen)
    if missing:
        raise UserError(
            f"train.init_from {directory}: the draft has no {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''} (tensors training's draft has)"
        )
    ignored = sorted(set(theirs) - set(ours) - set(NOT_TRAINED))
    if ignored:
        raise UserError(
            f"train.init_from {directory}: the draft has tensors training's draft has not "
            f"({', '.join(ignored[:4])}); its shape or options differ from train's settings"
        )
    head_rows = 0
    with torch.no_grad():
        for name, tensor in ours.items():
            if name not in theirs:
                continue  # frozen, kept at its start
            source = theirs[name]
            if name == "lm_head.weight":
                head_rows = _copy_head_rows(tensor, source, d2t, theirs.get("d2t"))
                continue
            if source.shape != tensor.shape:
                raise UserError(
                    f"train.init_from {directory}: {name} has shape {tuple(source.shape)}, "
                    f"training's draft {tuple(tensor.shape)}"
                )
            tensor.copy_(source.to(tensor.dtype))
    return (
        f"started from the draft in {directory}: {len(ours)} tensors, lm_head rows of "
        f"{head_rows} of the {len(d2t)} draft tokens (the rest: the verifier's)"
    )


def _copy_head_rows(ours, theirs, d2t, their_d2t) -> int:
    """lm_head rows by verifier token id: each token both draft vocabularies hold takes the old
    draft's row. Returns how many did."""
    import torch

    our_tokens = torch.arange(len(d2t)) + d2t.to(torch.int64)
    if their_d2t is None:  # the whole vocabulary: draft id = token id
        their_tokens = torch.arange(theirs.shape[0])
    else:
        their_tokens = torch.arange(len(their_d2t)) + their_d2t.to(torch.int64)
    row_of = {int(t): i for i, t in enumerate(their_tokens.tolist())}
    taken = 0
    for i, token in enumerate(our_tokens.tolist()):
        j = row_of.get(int(token))
        if j is not None:
            ours[i].copy_(theirs[j].to(ours.dtype))
            taken += 1
    return taken
