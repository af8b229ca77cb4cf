"""The train stage's typed definition (``config[train]``); part of ``definitions.py``'s one
definition per stage (see there for result and execution settings), kept in its own file for
its size: the training recipe's settings, each described where the schema and docs/training.md
read it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Literal

from pydantic import Field, field_validator, model_validator

from workflow_scripts.lib.workflow.params_base import StageParams


class TrainParams(StageParams):
    """EAGLE-3 draft training with training-time test (TTT)."""

    @model_validator(mode="after")
    def _mla_serves_no_norm_before_fc(self) -> "TrainParams":
        if self.draft_attention == "mla" and self.norm_before_fc:
            raise ValueError(
                "train.norm_before_fc with train.draft_attention mla: vLLM's MLA EAGLE-3 draft "
                "has no norm over the concatenated auxiliary states; set train.norm_before_fc: "
                "false"
            )
        if self.draft_attention == "mla" and self.num_draft_layers > 1:
            raise ValueError(
                "train.num_draft_layers above 1 with train.draft_attention mla: vLLM's MLA "
                "EAGLE-3 draft has one layer; set train.num_draft_layers: 1 or "
                "train.draft_attention: llama"
            )
        if self.draft_attention == "mla" and self.draft_layer != "llama":
            raise ValueError(
                f"train.draft_layer {self.draft_layer} with train.draft_attention mla: vLLM "
                "serves an MLA EAGLE-3 draft as one DeepSeek layer only; set "
                "train.draft_layer: llama or train.draft_attention: llama"
            )
        if self.draft_attention == "mla" and self.fc_norm:
            raise ValueError(
                "train.fc_norm with train.draft_attention mla: the per-layer fc norms are written "
                "and served for Llama-layer drafts only (the MLA draft's checkpoint has none); "
                "set train.fc_norm: false or train.draft_attention: llama"
            )
        return self

    @model_validator(mode="after")
    def _window_fits(self) -> "TrainParams":
        window = self.sliding_window_tokens
        if window is None:
            return self
        if self.draft_attention == "mla":
            raise ValueError(
                "train.sliding_window_tokens with train.draft_attention mla: vLLM serves the "
                "sliding window for the Llama and Qwen3 draft layers only; set "
                "train.sliding_window_tokens: null or train.draft_attention: llama"
            )
        steps = max(self.ttt_steps, self.num_speculative_tokens)
        if window <= steps:
            raise ValueError(
                f"train.sliding_window_tokens {window} is not above the draft's steps ({steps}, "
                "the larger of train.ttt_steps and train.num_speculative_tokens): the last "
                "drafted token would see none of the context; give a window of at least "
                f"{steps + 1}, and in practice hundreds of tokens"
            )
        return self

    @field_validator("report_to")
    @classmethod
    def _backends_installed(cls, names: list[str]) -> list[str]:
        """Nothing is installed at run time: a backend that cannot be imported here is refused
        now (at the dry-run, and in the job before anything loads)."""
        for name in sorted(set(names)):
            if names.count(name) > 1:
                raise ValueError(f"train.report_to lists {name} twice; list each backend once")
            if importlib.util.find_spec(name) is None:
                raise ValueError(
                    f"train.report_to lists {name}, which this Python ({sys.executable}) cannot "
                    f"import: pip install {name}, as envs/requirements-cpu.txt and "
                    f"requirements-gpu.txt have it, or remove {name} from train.report_to"
                )
        return names

    @property
    def processes_per_node(self) -> int:
        """Training processes on each node: one per GPU, or num_cpu_processes on the CPU."""
        return self.num_gpus if self.num_gpus > 0 else self.num_cpu_processes

    def job_gpus(self, extract) -> int:
        """The GPUs each node of the train job reserves: training's, and with extract.disk_budget
        the engine's beside them (``extract``: the extract settings), or the larger of the two
        where extract.share_training_gpus (the one place this sum is made)."""
        if extract.disk_budget is None:
            return self.num_gpus
        if extract.share_training_gpus:
            return max(self.num_gpus, extract.gpus)
        return self.num_gpus + extract.gpus

    EXECUTION = {
        "checkpoint_every_steps": "when the resumable state is saved; a resumed run repeats "
        "the uninterrupted one's steps exactly",
        "log_every_steps": "log lines (the metrics file has every step)",
        "report_to": "where the curves are shown besides the metrics file",
        "wandb_project": "where the W&B run is shown",
        "wandb_run_name": "the W&B run's display name",
    }

    seed: int = Field(0, description="Seed for initialisation, shuffling and the split.")
    ttt_steps: int = Field(3, ge=1, description="Training-time-test steps unrolled per position.")
    ttt_step_loss_decay: float = Field(
        1.0, gt=0, le=1, description="Loss weight of TTT step k is decay**k."
    )
    aux_noise: float = Field(
        0.0,
        ge=0,
        description="Uniform noise in [-aux_noise, aux_noise] added to the verifier's auxiliary "
        "hidden states of the training split (never the held-out one); speculators 0.7 used "
        "0.05 (0.9 adds none for EAGLE-3).",
    )
    loss_positions: Literal["all", "verifier_top1_in_draft_vocab"] = Field(
        "all",
        description="Positions trained on: every assistant token, or only those whose verifier "
        "top-1 (over its whole vocabulary) is in the draft vocabulary, which the draft can "
        "propose (as EAGLE and SpecForge train). Validation and its acceptance count all.",
    )
    norm_before_residual: bool = Field(
        True,
        description="The draft layer's residual: the normed feature (true, the speculators "
        "format's default) or the feature before hidden_norm (false, the one convention SGLang "
        "and TensorRT-LLM serve); vLLM serves both. Checkpoint key norm_before_residual.",
    )
    norm_before_fc: bool = Field(
        False,
        description="EAGLE-3.1: an RMSNorm over the concatenated auxiliary states before fc "
        "(checkpoint key norm_before_fc, served by vLLM).",
    )
    norm_output: bool = Field(
        False,
        description="EAGLE-3.1: the state fed back to the next draft step is the normed output "
        "instead of the one before the final norm (checkpoint key norm_output, served by vLLM).",
    )
    fc_norm: bool = Field(
        False,
        description="EAGLE-3.1 as vLLM reads it: an RMSNorm on each auxiliary state before fc "
        "(checkpoint key fc_norm, served by vLLM; after norm_before_fc's where both are on).",
    )
    loss: Literal["kl", "tv", "lk_alpha", "lk_hybrid"] = Field(
        "kl",
        description="Per-position loss against the teacher over the draft vocabulary: forward "
        "KL; tv, the total variation 1 - alpha (alpha = sum min(p, q), speculative sampling's "
        "acceptance rate); lk_alpha, -log alpha; lk_hybrid, lambda KL + (1 - lambda) tv with "
        "lambda = exp(-lk_eta alpha) (the LK losses SpecForge trains with). Validation reports KL "
        "whichever is trained.",
    )
    lk_eta: float = Field(
        3.0, gt=0, description="lk_hybrid: how soon the loss moves from KL to tv as alpha grows."
    )
    topk_loss_weight: float = Field(
        0.0,
        ge=0,
        description="Weight w of a top-K term added to each position's loss: w x the draft's "
        "cross-entropy over the teacher's topk_loss_k most likely tokens (HASS's top-K "
        "distillation; 0: none).",
    )
    topk_loss_k: int = Field(10, ge=1, description="topk_loss_weight: the K of the top-K term.")
    ttt_positions: Literal["all", "accepted_chain"] = Field(
        "all",
        description="Positions trained at TTT steps after the first: every counted one, or "
        "accepted_chain, only those whose draft tokens of the steps before were all the "
        "verifier's argmax, the chain vLLM still extends under greedy decoding (GRIFFIN's token "
        "alignment; step k then weighs as the share of chains that reach it). Validation "
        "counts all.",
    )
    num_draft_layers: int = Field(
        1,
        ge=1,
        le=8,
        description="Decoder layers of the draft: the first reads the embedding and the "
        "verifier's features, the others the stream (vLLM serves layers.1.. of EAGLE-3 Llama "
        "drafts). Each layer adds its cost to every draft step when serving.",
    )
    freeze_lm_head: bool = Field(
        False,
        description="Keep the draft's lm_head at the verifier's rows for the draft vocabulary "
        "(as speculators trains) instead of training it from them.",
    )
    final_norm_init: Literal["verifier", "ones"] = Field(
        "verifier",
        description="The draft's final norm starts as the verifier's (its weight, plus the "
        "family's offset), or at ones (as speculators starts it).",
    )
    draft_attention: Literal["llama", "mla"] = Field(
        "llama",
        description="The draft layer's attention: llama (a Llama decoder layer, speculators "
        "format), or mla (multi-head latent attention with the verifier's MLA shape, for "
        "DeepSeek-V3 and Kimi-K2 verifiers: a smaller KV cache, the verifier's attention "
        "backend; written as vLLM's Eagle3DeepseekV2ForCausalLM checkpoint).",
    )
    draft_layer: Literal["llama", "qwen3"] = Field(
        "llama",
        description="The draft's decoder layer: llama, or qwen3 (the Llama layer with an "
        "RMSNorm over each query and key head before RoPE, as Qwen3 has; written with "
        "model_type qwen3 in transformer_layer_config, which vLLM serves as "
        "Eagle3Qwen3ForCausalLM). With draft_attention mla the layer is DeepSeek's.",
    )
    sliding_window_tokens: int | None = Field(
        None,
        ge=1,
        description="A sliding window for the draft's attention: each query sees this many "
        "most recent tokens, its own included, in training and as vLLM serves the checkpoint "
        "(layer_types sliding_attention and sliding_window in transformer_layer_config), in "
        "every draft layer (vLLM keeps a draft's layers in one KV cache group); null: full "
        "attention. Checked at dry-run against the verifier's maximum length.",
    )
    init_from: str | None = Field(
        None,
        description="Start from an existing draft instead of from nothing: the directory of an "
        "EAGLE-3 draft for this verifier (speculators format: config.json and .safetensors; one "
        "this workflow trained, copied out of results_dir, or a published one). Checked at "
        "dry-run against the verifier, train.draft_layer, train.num_draft_layers, the EAGLE-3.1 "
        "options and extract.aux_layer_ids; its lm_head rows are taken for the tokens both draft "
        "vocabularies hold. A change of its files reruns train.",
    )
    epochs: int = Field(10, ge=1, description="Passes over the training split.")
    shuffle_window_shards: int | None = Field(
        None,
        ge=1,
        description="How far an epoch shuffles: null, every sample with every other; n, the "
        "shards are taken in a seeded order, n at a time, and only their samples shuffled "
        "together, so that few shards are read at once (what extract.disk_budget needs). The "
        "same order whether the states come from disk or are recomputed.",
    )
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
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw on every trained parameter, or muon on the weight matrices (fc, "
        "attention, MLP) with AdamW on the rest (norms, lm_head), as speculators trains.",
    )
    learning_rate: float = Field(1e-4, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    muon_learning_rate: float = Field(
        1e-3, gt=0, description="optimizer muon: peak Muon learning rate (AdamW-matched RMS)."
    )
    muon_momentum: float = Field(0.95, gt=0, lt=1, description="optimizer muon: momentum.")
    muon_weight_decay: float = Field(0.1, ge=0, description="optimizer muon: weight decay.")
    warmup_steps: int = Field(100, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["cosine", "linear"] = Field(
        "cosine", description="Decay after the warm-up, to min_lr_ratio at the last step."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Decay floor, x peak.")
    grad_clip_norm: float = Field(1.0, gt=0, description="Gradient clipping max norm.")
    validation_fraction: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Share of samples held out (a seeded split), scored every "
        "validate_every_steps and at the end.",
    )
    validate_every_steps: int = Field(
        200,
        ge=1,
        description="Optimizer steps between scores of the held-out split (and at the end); the "
        "draft written is the best of them by select_by.",
    )
    select_by: Literal["simulated_acceptance", "validation_loss"] = Field(
        "simulated_acceptance",
        description="Which validation's weights are written: the highest simulated acceptance "
        "length (as vLLM would accept greedily), or the lowest KL (as speculators keeps).",
    )
    checkpoint_every_steps: int = Field(
        200, ge=1, description="Optimizer steps between resumable checkpoints (atomic)."
    )
    log_every_steps: int = Field(10, ge=1, description="Optimizer steps between log lines.")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        [],
        description="Where the training curves go besides metrics.jsonl: every row of it "
        "(loss, per-step agreement and acceptance, learning rate, validation, throughput) against "
        "the optimizer step, from the main process. tensorboard: event files in "
        "<results_dir>/train/tensorboard/<run id> (tensorboard --logdir "
        "<results_dir>/train/tensorboard); wandb: a Weights & Biases run, its files in "
        "<results_dir>/train/wandb, offline unless W&B is configured (WANDB_MODE, WANDB_API_KEY "
        "or wandb login; upload an offline run with wandb sync). A resumed training continues "
        "the same curves. Each must be installed (both are in envs/requirements-*.txt).",
    )
    wandb_project: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[^/\\#?%:]+$",
        description="report_to wandb: the W&B project; null: the name of results_dir.",
    )
    wandb_run_name: str | None = Field(
        None,
        min_length=1,
        description="report_to wandb: the run's name; null: its id (<date>-<time>-<4 hex "
        "digits>, the name of its TensorBoard directory too), which a resumed training keeps.",
    )
    num_gpus: int = Field(
        0,
        ge=0,
        description="GPUs for torchrun DDP; 0 trains on the CPU. A result setting: the number "
        "of processes sets the global batch (processes x grad_accum_steps micro-batches), and "
        "GPUs train in bf16.",
    )
    num_nodes: int = Field(
        1,
        ge=1,
        description="Nodes training runs on, each with num_gpus GPUs (or num_cpu_processes on "
        "the CPU): one SLURM job over whole nodes, one torchrun per node started by srun. A "
        "result setting: nodes x processes per node sets the global batch; 2 nodes x 1 process "
        "train the weights of 1 node x 2.",
    )
    num_cpu_processes: int = Field(
        1,
        ge=1,
        description="CPU only (num_gpus 0): DDP processes (gloo) under torchrun, sharing the "
        "cores. A result setting: the number of processes sets the global batch.",
    )
    num_speculative_tokens: int = Field(
        3,
        ge=1,
        description="Speculative tokens written into the checkpoint's proposal method, and the k "
        "of the simulated acceptance length by which the validation whose weights are kept is "
        "chosen.",
    )
