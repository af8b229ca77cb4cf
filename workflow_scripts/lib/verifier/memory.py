"""The verifier in an engine's memory: the KV cache one sequence takes (from the verifier's
config: layers, key/value heads or MLA's latent, dtype, split over tensor and pipeline parallel
ranks) and its weights, checked against a stage's engine settings and the memory of one GPU, at
dry-run (``gpu_memory_bytes``) and in each job (its own GPUs). vLLM makes the same checks only
after the model has loaded. Lower bounds throughout: what is refused cannot start.

No torch: the dry-run stays within seconds.
"""

from __future__ import annotations

from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier.files import own_dtype, uses_mla

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the largest KV cache block of vLLM's attention backends (tokens): a sequence takes whole blocks,
# and the block pool holds one back
MAX_BLOCK_TOKENS = 256


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def cached_windows(cfg: dict[str, Any]) -> list[int | None]:
    """The tokens each layer with a KV cache keeps of a sequence: None for all of them (full
    attention), the window for sliding-window layers; layers without one (linear attention,
    state-space) are left out."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    kinds = cfg.get("layer_types") or ["sliding_attention" if window else "full_attention"] * n
    return [
        None if kind == "full_attention" else int(window)
        for kind in kinds[:n]
        if kind == "full_attention" or (kind == "sliding_attention" and window)
    ]


def kv_token_bytes(cfg: dict[str, Any], dtype: str, tp: int) -> tuple[int, str]:
    """KV cache bytes of one token in one layer on one GPU (or CPU worker) at tensor parallel
    size ``tp``, and how they come about. MLA keeps one latent a token (kv_lora_rank +
    qk_rope_head_dim) on every rank; other attention keys and values of the key/value heads of
    its rank, each head on one rank, or on several where tp exceeds the heads."""
    size = DTYPE_BYTES[dtype]
    if uses_mla(cfg):
        rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        how = f"(kv_lora_rank {rank} + qk_rope_head_dim {rope}) x {size} bytes ({dtype})"
        return (rank + rope) * size, how + ", the same on every tensor-parallel rank"
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    per_rank = -(-kv_heads // tp)
    how = (
        f"keys and values of {per_rank} of its {kv_heads} key/value heads at "
        f"tensor_parallel_size {tp} x head_dim {head_dim} x {size} bytes ({dtype})"
    )
    return 2 * per_rank * head_dim * size, how


def kv_cache_need(cfg: dict[str, Any], dtype: str, tp: int, pp: int, tokens: int) -> int:
    """The least KV cache (bytes, on each GPU or CPU worker) that holds one sequence of
    ``tokens``: a lower bound of vLLM's own check, which also rounds to its cache blocks."""
    held = sum(tokens if w is None else min(tokens, w) for w in cached_windows(cfg))
    return kv_token_bytes(cfg, dtype, tp)[0] * -(-held // pp)


def longest_fitting(cfg: dict[str, Any], dtype: str, tp: int, pp: int, kv_bytes: float) -> int:
    """The most tokens whose sequence ``kv_bytes`` of KV cache holds (0: not one)."""
    low, high = 0, 1 << 24
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (
            (mid, high) if kv_cache_need(cfg, dtype, tp, pp, mid) <= kv_bytes else (low, mid - 1)
        )
    return low


def check_kv_cache(settings, section: str, cfg: dict[str, Any], dtype: str) -> None:
    """``<section>.kv_cache_memory_bytes`` against one sequence of
    ``<section>.max_model_len_tokens`` of the verifier (vLLM refuses it only after the model has
    loaded)."""
    kv, tokens = settings.kv_cache_memory_bytes, settings.max_model_len_tokens
    if kv is None:
        return
    tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
    need = kv_cache_need(cfg, dtype, tp, pp, tokens)
    if kv >= need:
        return
    per_token, how = kv_token_bytes(cfg, dtype, tp)
    layers = len(cached_windows(cfg))
    where = "GPU" if settings.use_gpus else "engine worker"
    blocks = -(-tokens // MAX_BLOCK_TOKENS) + 1  # whole blocks, and the one the pool holds back
    least = kv_cache_need(cfg, dtype, tp, pp, blocks * MAX_BLOCK_TOKENS)
    fit = longest_fitting(cfg, dtype, tp, pp, kv)
    shorter = f", or lower {section}.max_model_len_tokens to {fit}" if fit >= 8 else ""
    share = (
        f", or null to use what {section}.gpu_memory_utilization leaves"
        if settings.use_gpus
        else ""
    )
    raise UserError(
        f"{section}.kv_cache_memory_bytes {kv} ({gb(kv)}) cannot hold one sequence of "
        f"{section}.max_model_len_tokens {tokens} tokens of this verifier, which takes {need} "
        f"bytes ({gb(need)}) of KV cache on each {where}: {per_token} bytes a token and layer "
        f"({how}) over {layers} layers{f' / pipeline_parallel_size {pp}' if pp > 1 else ''}. "
        f"vLLM would refuse it after loading the model; set {section}.kv_cache_memory_bytes to "
        f"{least} or more (room for vLLM's cache blocks too){share}{shorter}"
    )


def weights_in_memory(cfg: dict[str, Any], disk_bytes: int, dtype: str) -> int:
    """The verifier's weights in the engine's memory, from their bytes on disk: less where the
    engine runs a floating-point checkpoint in a narrower dtype (a lower bound: never more than
    on disk)."""
    own = DTYPE_BYTES.get(own_dtype(cfg) or "")
    return int(disk_bytes * min(1.0, DTYPE_BYTES[dtype] / own)) if own else disk_bytes


def _parallel_sizes(cfg: dict[str, Any], above: int) -> list[int]:
    """Tensor parallel sizes above ``above`` that ``check_parallel`` allows, up to 64."""
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return [
        t for t in range(above + 1, 65) if not heads % t and (not kv_heads % t or not t % kv_heads)
    ]


def check_gpu_memory(
    settings,
    section: str,
    cfg: dict[str, Any],
    dtype: str,
    weights: int,
    gpu_bytes: int,
    source: str,
) -> None:
    """A vLLM engine on GPUs against the memory of one GPU (``gpu_bytes``; ``source``: where that
    figure comes from): the verifier's weights in memory (``weights``; 0: not known) split over
    ``<section>.tensor_parallel_size`` x ``pipeline_parallel_size`` GPUs, within the engine's
    share of each GPU (or beside ``kv_cache_memory_bytes``, which replaces the share), with room
    for one sequence's KV cache. Activations, CUDA graphs and communication buffers are not
    counted: what is refused cannot start, and what passes may still need more."""
    if not settings.use_gpus:
        return
    tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
    tokens, kv = settings.max_model_len_tokens, settings.kv_cache_memory_bytes
    share = 1.0 if kv is not None else settings.gpu_memory_utilization
    budget = share * gpu_bytes

    def needs(t: int) -> tuple[int, int]:  # (weights, KV cache) a GPU at tensor parallel size t
        return weights // (t * pp), (
            kv if kv is not None else kv_cache_need(cfg, dtype, t, pp, tokens)
        )

    per_gpu, cache = needs(tp)
    if per_gpu + cache <= budget:
        return
    split = f"{section}.tensor_parallel_size {tp}" + (
        f" x {section}.pipeline_parallel_size {pp}" if pp > 1 else ""
    )
    gpu = f"one GPU's {gb(gpu_bytes)} ({source})"
    weights_on = f"the verifier's weights ({gb(weights)}) on {split} GPU(s), {gb(per_gpu)} a GPU"
    nodes = getattr(settings, "num_nodes", 1)
    per_node = tp // nodes  # over several nodes, more GPUs are more nodes of as many GPUs

    def more(t: int) -> str:
        over = f" over {section}.num_nodes {t // per_node}" if nodes > 1 else ""
        return f"raise {section}.tensor_parallel_size to {t}{over}"

    fixes = [
        more(t)
        for t in _parallel_sizes(cfg, tp)
        if sum(needs(t)) <= budget and (nodes == 1 or t % per_node == 0)
    ][:1]
    if kv is not None:
        what = f"{weights_on}, and {section}.kv_cache_memory_bytes {kv} ({gb(kv)}) exceed {gpu}"
        fixes.append(
            f"lower {section}.kv_cache_memory_bytes (null: what "
            f"{section}.gpu_memory_utilization leaves)"
        )
    elif per_gpu > budget:
        what = (
            f"{weights_on}, exceed {section}.gpu_memory_utilization {share} of {gpu}, "
            f"{gb(budget)}"
        )
    else:
        what = (
            f"{section}.gpu_memory_utilization {share} of {gpu} leaves {gb(budget - per_gpu)} "
            f"for the KV cache after {weights_on}: less than one sequence of "
            f"{section}.max_model_len_tokens {tokens} takes ({cache} bytes, {gb(cache)}); vLLM "
            "would refuse it after loading the model"
        )
        fit = longest_fitting(cfg, dtype, tp, pp, budget - per_gpu)
        if fit >= 8:
            fixes.append(f"lower {section}.max_model_len_tokens to {fit}")
    least_share = -(-(per_gpu + cache) * 100 // gpu_bytes) / 100
    if kv is None and least_share <= 0.95:
        fixes.append(f"raise {section}.gpu_memory_utilization to {least_share:.2f} at least")
    if not fixes:
        fixes.append(
            f"split it over more GPUs ({section}.pipeline_parallel_size), or use larger ones"
        )
    raise UserError(f"{what}; {', or '.join(fixes)}")


def engine_sections(cfg) -> list[str]:
    """The config sections of the stages that run the verifier in vLLM (the engine of a disk
    budget runs with extract's settings)."""
    return [
        *(["regenerate"] if cfg.regenerate.enabled else []),
        *(["extract"] if cfg.extract.backend == "vllm" else []),
        "evaluate",
    ]


def check_gpus(
    gpu_bytes: int | None,
    vcfg: dict[str, Any],
    weights: int,
    engines: list[tuple[str, Any, str]],
    staged: dict[str, list[str]],
) -> list[str]:
    """At dry-run: each vLLM engine on GPUs (``engines``: its section, settings and dtype) against
    ``gpu_bytes`` (config key gpu_memory_bytes; ``weights``: the verifier's bytes on disk), its
    problems added to ``staged`` by stage unless it has some already. Returns a warning where
    gpu_memory_bytes is not set: then each job checks against its own GPUs before its model
    loads."""
    unchecked = []
    for section, settings, dtype in engines:
        if not settings.use_gpus or section in staged:
            continue
        if gpu_bytes is None:
            unchecked.append(section)
            continue
        held = weights_in_memory(vcfg, weights, dtype)
        try:
            check_gpu_memory(settings, section, vcfg, dtype, held, gpu_bytes, "gpu_memory_bytes")
        except UserError as exc:
            staged.setdefault(section, []).append(str(exc))
    if not unchecked:
        return []
    names = (
        ", ".join(unchecked[:-1]) + " and " + unchecked[-1] if len(unchecked) > 1 else unchecked[0]
    )
    return [
        f"gpu_memory_bytes is not set: whether the verifier's weights and one sequence's KV cache "
        f"fit the GPUs of {names} is checked when each job starts, before its model loads; set "
        "gpu_memory_bytes to the memory of one GPU (e.g. '80GB') to check it now"
    ]
