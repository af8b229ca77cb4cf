"""The verifier on disk: its config, weight files, tokenizer and chat template, its identity, and
the few tensors the draft takes from it. Every stage that reads the verifier goes through here.

torch and transformers are imported only by the functions that need them, so that the dry-run
checks and the light jobs can use this module without them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from workflow_scripts.lib.common import UserError, read_json, sha256_file

CONFIG_FILE = "config.json"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# what a tokenizer can be made of; those present are part of the verifier's identity
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")
log = logging.getLogger("eagle3")


# --------------------------------------------------------------------------- config


def verifier_config(verifier_dir: Path | str) -> dict[str, Any]:
    """The verifier's config.json, checked for what every stage needs (the language model's
    config inside multimodal wrappers)."""
    path = Path(verifier_dir) / CONFIG_FILE
    cfg = read_json(path)
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing and "text_config" in cfg:  # multimodal wrappers keep the LLM's config inside
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
        missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise UserError(f"{path}: missing {', '.join(missing)}; is this a causal LM config?")
    return cfg


def is_multimodal_wrapper(verifier_dir: Path | str) -> bool:
    """A multimodal verifier (Kimi-K2.5, Qwen3-VL, ...): its language model's config sits in
    ``text_config`` beside its towers'. Engines load only the language model: every stage here
    is text."""
    return "text_config" in read_json(Path(verifier_dir) / CONFIG_FILE)


def uses_mla(cfg: dict[str, Any]) -> bool:
    """The verifier's attention is multi-head latent attention (DeepSeek-V3, Kimi-K2.5)."""
    return bool(cfg.get("kv_lora_rank")) and bool(cfg.get("qk_rope_head_dim"))


def own_dtype(cfg: dict[str, Any]) -> str | None:
    """The dtype the verifier's weights are stored in, as config.json names it."""
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return str(value) if value else None


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def aux_layer_ids(cfg: dict[str, Any], requested: list[int] | None) -> list[int]:
    """The auxiliary layer ids (config key extract.aux_layer_ids), checked against the verifier
    and ascending (the order vLLM collects them in)."""
    n = int(cfg["num_hidden_layers"])
    ids = default_aux_layer_ids(n) if requested is None else list(requested)
    origin = (
        f"the default [2, N//2, N-3] gives {ids} for a verifier of {n} layers"
        if requested is None
        else f"extract.aux_layer_ids is {ids}"
    )
    if not ids:
        raise UserError("extract.aux_layer_ids is empty; give at least one layer id or null")
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise UserError(
            f"{origin}: {bad} out of range for a verifier of {n} layers. Auxiliary ids are in "
            f"0..{n - 1} (vLLM's convention: id k is the input of decoder layer k; the final "
            f"state, id {n}, is always stored besides); change extract.aux_layer_ids"
        )
    if len(set(ids)) != len(ids):
        spread = sorted(set(np.linspace(1, n - 2, 3).round().astype(int).tolist()))
        raise UserError(
            f"{origin}, which repeats a layer (vLLM would crash on it after loading the model); "
            f"set extract.aux_layer_ids to distinct ids in 0..{n - 1}, e.g. {spread}"
        )
    if ids != sorted(ids):
        log.warning(
            "extract.aux_layer_ids %s: stored in ascending order %s, the order vLLM collects them in",
            ids,
            sorted(ids),
        )
    return sorted(ids)


# --------------------------------------------------------------------------- files


def weight_files(verifier: Path | str) -> list[Path]:
    """The verifier's weight files; a UserError if there are none or the index names missing ones."""
    verifier = Path(verifier)
    if not verifier.is_dir():
        raise UserError(f"verifier directory '{verifier}' does not exist (config key 'verifier')")
    for index_name in WEIGHT_INDEXES:
        index = verifier / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as exc:
                raise UserError(f"{index}: unreadable weight index ({exc!r})") from None
            missing = [n for n in names if not (verifier / n).is_file()]
            if missing:
                raise UserError(
                    f"verifier '{verifier}': {len(missing)} weight file(s) named in {index_name} "
                    f"are missing (e.g. {missing[0]}); is the download complete?"
                )
            return [verifier / n for n in names]
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in verifier.glob(pattern)})
    if not files:
        raise UserError(
            f"verifier '{verifier}' has a config.json but no weights (*.safetensors or "
            "pytorch_model*.bin); is the download complete? (config key 'verifier')"
        )
    return files


def weights_bytes(verifier: Path | str) -> int:
    """The size of the verifier's weights: the index's ``metadata.total_size`` where it has one,
    else the weight files' sizes on disk (0 where neither tells)."""
    verifier = Path(verifier)
    for index_name in WEIGHT_INDEXES:
        index = verifier / index_name
        if index.is_file():
            try:
                total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
            except json.JSONDecodeError:
                total = None
            if total:
                return int(total)
    return sum(f.stat().st_size for f in weight_files(verifier) if f.is_file())


def identity(verifier: Path | str) -> dict[str, Any]:
    """What makes this verifier this verifier: config.json's sha256, the weight files' names and
    sizes (hashing hundreds of GB would take longer than most stages), the tokenizer files'
    sha256; and one ``fingerprint`` of all three. Every record of "which verifier" uses it."""
    verifier = Path(verifier)
    found = {
        "config_sha256": sha256_file(verifier / CONFIG_FILE),
        "weights": [[f.name, f.stat().st_size] for f in weight_files(verifier)],
        "tokenizer_sha256": {
            name: sha256_file(verifier / name)
            for name in TOKENIZER_FILES
            if (verifier / name).is_file()
        },
    }
    blob = json.dumps(found, sort_keys=True).encode()
    return {**found, "fingerprint": hashlib.sha256(blob).hexdigest()}


def fingerprint(verifier: Path | str) -> str:
    return identity(verifier)["fingerprint"]


# --------------------------------------------------------------------------- tokenizer


def chat_template_on_disk(verifier: Path | str) -> bool:
    """Whether the tokenizer files carry a chat template (read without transformers)."""
    verifier = Path(verifier)
    if (verifier / "chat_template.jinja").is_file() or (verifier / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((verifier / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(config.get("chat_template"))


def load_tokenizer(verifier: Path | str, trust_remote_code: bool = False):
    """The verifier's tokenizer, with a chat template (its own code with ``trust_remote_code``:
    config key chat_template.trust_remote_code)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(verifier), trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # transformers raises many kinds; all mean the same to the user
        hint = (
            ""
            if trust_remote_code
            else " (if the verifier ships its own tokenizer code, set "
            "chat_template.trust_remote_code: true)"
        )
        raise UserError(
            f"cannot load the tokenizer of verifier '{verifier}': {exc}{hint}"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"the tokenizer of verifier '{verifier}' has no chat template; add 'chat_template' "
            "to its tokenizer_config.json (or a chat_template.jinja file beside it)"
        )
    return tokenizer


# --------------------------------------------------------------------------- tensors


def _weight_map(verifier_dir: Path) -> dict[str, Path]:
    from safetensors import safe_open

    index = verifier_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise UserError(f"cannot read {index}: {exc}") from None
        return {name: verifier_dir / file for name, file in weight_map.items()}
    files = sorted(verifier_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{verifier_dir}: no safetensors weights (model.safetensors or an index)")
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            names.update({name: file for name in fh.keys()})
    return names


def _pick(names: list[str], suffix: str, prefix: str | None = None) -> str | None:
    if prefix is not None and prefix + suffix in names:
        return prefix + suffix
    pattern = re.compile(r"(^|\.)" + re.escape(suffix) + "$")
    found = [
        n
        for n in names
        if pattern.search(n) and not re.search(r"(^|\.)(layers|mtp|vision|visual)\.", n)
    ]
    return min(found, key=len) if found else None


def locate_tensors(verifier_dir: Path | str, vcfg: dict) -> dict[str, tuple[Path, str]]:
    """Where the embedding, the final norm and the lm_head are (lm_head: the embedding when the
    weights are tied), with their shapes checked."""
    from safetensors import safe_open

    verifier_dir = Path(verifier_dir)
    weight_map = _weight_map(verifier_dir)
    names = list(weight_map)
    embed = _pick(names, "embed_tokens.weight")
    if embed is None:
        raise UserError(f"{verifier_dir}: no embed_tokens.weight among the verifier's tensors")
    prefix = embed[: -len("embed_tokens.weight")]
    norm = _pick(names, "norm.weight", prefix)
    if norm is None:
        raise UserError(f"{verifier_dir}: no final norm.weight among the verifier's tensors")
    lm_head = _pick(names, "lm_head.weight")
    quantized = [
        n
        for n in names
        if re.search(
            r"(^|\.)(lm_head|embed_tokens)\.(weight_packed|qweight|weight_scale|scales)$", n
        )
    ]
    if quantized:
        raise UserError(
            f"{verifier_dir}: the verifier's {quantized[0].rsplit('.', 1)[0]} is quantized "
            f"({quantized[0]}): the draft and its teacher need the embedding and the lm_head in "
            "floating point (quantized experts and layers are fine); use a checkpoint whose "
            "quantization leaves lm_head and embed_tokens out (compressed-tensors: 'ignore')"
        )
    if lm_head is None:
        if vcfg.get("tie_word_embeddings") is False:
            raise UserError(f"{verifier_dir}: no lm_head.weight, and the embeddings are not tied")
        lm_head = embed
    located = {
        k: (weight_map[n], n) for k, n in (("embed", embed), ("norm", norm), ("lm_head", lm_head))
    }
    H, V = int(vcfg["hidden_size"]), int(vcfg["vocab_size"])
    expected = {"embed": [V, H], "norm": [H], "lm_head": [V, H]}
    for key, (file, name) in located.items():
        if not file.is_file():
            raise UserError(f"{verifier_dir}: {name} should be in {file.name}, which is missing")
        with safe_open(str(file), framework="pt") as fh:
            tensor = fh.get_slice(name)
            shape, dtype = list(tensor.get_shape()), tensor.get_dtype()
        if dtype not in ("F32", "F16", "BF16"):
            raise UserError(
                f"{file}: {name} is stored as {dtype}: the draft and its teacher need the "
                "embedding, final norm and lm_head in floating point (F32, F16 or BF16)"
            )
        if shape != expected[key]:
            raise UserError(
                f"{file}: {name} has shape {shape}, expected {expected[key]} from config.json"
            )
    return located


def read_tensor(where: tuple[Path, str], rows=None, chunk_rows: int = 8192):
    """One tensor from a safetensors file; with ``rows`` (a bool mask) only those rows, read in
    chunks so a large lm_head never sits in memory whole."""
    import torch
    from safetensors import safe_open

    file, name = where
    with safe_open(str(file), framework="pt") as fh:
        tensor = fh.get_slice(name)
        if rows is None:
            return tensor[:]
        parts = []
        for start in range(0, rows.numel(), chunk_rows):
            select = rows[start : start + chunk_rows]
            if select.any():
                parts.append(tensor[start : start + select.numel()][select])
        return torch.cat(parts)
