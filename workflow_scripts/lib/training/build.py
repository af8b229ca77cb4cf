"""What the training loop starts from and ends with: the draft and its teacher built from the
verifier, the learning-rate schedule, the summary of a batch's statistics, and the draft
checkpoint vLLM serves.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import torch

from workflow_scripts.lib.draft.checkpoint import (
    mla_draft_config,
    speculators_config,
    write_draft_checkpoint,
)
from workflow_scripts.lib.training.init_from import load_init_weights
from workflow_scripts.lib.draft.layer_config import draft_layer_config
from workflow_scripts.lib.draft.model import DraftConfig, Eagle3Draft, TeacherHead
from workflow_scripts.lib.draft.teacher_head import HeadSpec
from workflow_scripts.lib.training.loader import MicroBatch
from workflow_scripts.lib.training.inputs import Inputs
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.code_inputs import made_by
from workflow_scripts.lib.workflow.definitions import TrainParams
from workflow_scripts.lib.workflow.registry import TrainIO

log = logging.getLogger("eagle3")


def lr_factor(
    step: int, warmup: int, total: int, min_ratio: float, schedule: str = "cosine"
) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then a cosine (or linear) decay to
    ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def make_optimizer(model: Eagle3Draft, p: TrainParams) -> torch.optim.Optimizer:
    """AdamW on every trainable parameter (``train.optimizer: adamw``), or Muon on the weight
    matrices (the fc, attention and MLP projections: 2-D, hidden layers) with AdamW on the rest
    (norms; the lm_head when trained, an output layer Muon is not meant for), as speculators
    trains (``muon``). One optimizer either way, its groups scheduled together."""
    params = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    if p.optimizer == "adamw":
        return torch.optim.AdamW(
            [q for _, q in params], lr=p.learning_rate, weight_decay=p.weight_decay
        )
    is_matrix = {n: q.ndim == 2 and not n.startswith("lm_head.") for n, q in params}
    matrices = [q for n, q in params if is_matrix[n]]
    rest = [q for n, q in params if not is_matrix[n]]
    return CombinedOptimizer(
        [
            torch.optim.Muon(
                matrices,
                lr=p.muon_learning_rate,
                momentum=p.muon_momentum,
                weight_decay=p.muon_weight_decay,
                adjust_lr_fn="match_rms_adamw",
            ),
            torch.optim.AdamW(rest, lr=p.learning_rate, weight_decay=p.weight_decay),
        ]
    )


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one (their parameter groups in one list, so that one
    learning-rate scheduler scales each group from its own peak, and one state dict resumes
    them)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.defaults = {}
        self.state = {}

    @torch.no_grad()
    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state):
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)


def summarize(stats: torch.Tensor, decay: float, num_speculative_tokens: int) -> dict[str, Any]:
    """stats [STAT_KEYS, S] summed over a batch -> loss and per-step figures.

    ``top1_agreement``: the draft's top-1 equals the teacher's inside the draft vocabulary (what
    the loss trains); ``top1_agreement_full_vocab``: equals the verifier's argmax over its whole
    vocabulary; ``acceptance_per_position``: the share of anchors whose draft tokens up to this
    position vLLM would all accept (greedy), and from it ``simulated_acceptance_length`` at
    ``num_speculative_tokens`` (1 + the sum of the first k: every position an anchor); where the
    batch was walked, ``walked_acceptance_by_k``: the same chains counted as greedy decoding
    counts them at k = 1..S drafts a step, each step anchored after the drafts accepted (vLLM's
    figure on these answers)."""
    kl, correct, count, served, accepted, anchors, walk_steps, walk_accepted = stats
    count = count.clamp(min=1)
    per_step_kl = (kl / count).tolist()
    acceptance = (accepted / anchors.clamp(min=1)).tolist()
    walked = {}
    if bool((walk_steps > 0).all()):
        walked["walked_acceptance_by_k"] = [
            round(1 + v, 6) for v in (walk_accepted / walk_steps).tolist()
        ]
    return {
        "loss": sum(decay**k * v for k, v in enumerate(per_step_kl)),
        "kl_per_step": [round(v, 6) for v in per_step_kl],
        "top1_agreement": [round(v, 6) for v in (correct / count).tolist()],
        "top1_agreement_full_vocab": [round(v, 6) for v in (served / count).tolist()],
        "acceptance_per_position": [round(v, 6) for v in acceptance],
        "simulated_acceptance_length": round(1 + sum(acceptance[:num_speculative_tokens]), 6),
        "positions_per_step": [int(v) for v in stats[2].tolist()],
        **walked,
    }


def gpu_memory(device: torch.device) -> str:
    """', peak GPU memory X GiB' on a GPU (the most this process has held so far), else ''."""
    if device.type != "cuda":
        return ""
    return f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"


def fmt_list(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def build_draft(
    inputs: Inputs,
    p: TrainParams,
    embed_dtype: torch.dtype | None = torch.float32,
) -> tuple[Eagle3Draft, TeacherHead]:
    """The draft as training starts it, and the teacher. Both take the verifier's final norm and
    the draft vocabulary's lm_head rows: the teacher frozen, as the verifier's family computes
    them (``HeadSpec``), the draft as its starting point (its own norm is a plain RMSNorm, as
    vLLM serves it: started at the verifier's weight plus the family's offset, the same norm).
    The embedding is the verifier's, frozen (``embed_dtype`` None keeps the verifier's dtype)."""
    layer_config = draft_layer_config(inputs.verifier_cfg, p.draft_layer)
    if p.draft_attention == "mla":
        from workflow_scripts.lib.draft.mla import mla_layer_config

        layer_config = mla_layer_config(inputs.verifier_cfg, layer_config)
    layer_config["num_aux_hidden_states"] = len(inputs.aux_layer_ids)
    cfg = DraftConfig.from_layer_config(
        layer_config,
        inputs.d2t.numel(),
        len(inputs.aux_layer_ids),
        norm_before_residual=p.norm_before_residual,
        norm_before_fc=p.norm_before_fc,
        norm_output=p.norm_output,
        attention=p.draft_attention,
        fc_norm=p.fc_norm,
        num_layers=p.num_draft_layers,
        sliding_window=p.sliding_window_tokens,
    )
    embed = verifier_files.read_tensor(inputs.tensors["embed"])
    norm = verifier_files.read_tensor(inputs.tensors["norm"]).float()
    head_rows = verifier_files.read_tensor(inputs.tensors["lm_head"], rows=inputs.t2d).float()
    head = verifier_files.read_tensor(inputs.tensors["lm_head"])  # whole: the verifier's own argmax
    draft_to_verifier = torch.arange(inputs.d2t.numel()) + inputs.d2t.to(torch.int64)
    spec = HeadSpec.of(inputs.verifier_cfg)
    torch.manual_seed(p.seed)
    model = Eagle3Draft(cfg)
    model.embed_tokens.to(embed_dtype or embed.dtype)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head_rows)
        if p.final_norm_init == "verifier":
            model.norm.weight.copy_(norm + spec.norm_offset)
    if p.init_from is not None:  # an existing draft's weights (draft/init_from.py)
        log.info(load_init_weights(model, p.init_from, inputs.d2t))
    if p.freeze_lm_head:  # the verifier's rows, as they are (or the draft's it starts from)
        model.lm_head.weight.requires_grad_(False)
    teacher = TeacherHead(
        norm,
        head_rows,
        cfg.rms_norm_eps,
        head.to(embed_dtype or head.dtype),
        draft_to_verifier,
        spec,
    )
    return model, teacher


def write_draft(directory: Path, model: Eagle3Draft, inputs: Inputs, io: TrainIO, p: TrainParams):
    """The draft checkpoint vLLM serves (speculators format, see draft/checkpoint.py)."""
    vcfg = inputs.verifier_cfg
    dtype = vcfg.get("torch_dtype") or vcfg.get("dtype")
    common = dict(
        draft_vocab_size=inputs.d2t.numel(),
        aux_layer_ids=inputs.aux_layer_ids,
        num_speculative_tokens=p.num_speculative_tokens,
        verifier_name_or_path=str(Path(io.verifier).resolve()),
        verifier_architectures=vcfg.get("architectures"),
        norm_before_residual=model.cfg.norm_before_residual,
        norm_output=model.cfg.norm_output,
        dtype=dtype if dtype in ("bfloat16", "float16") else "float32",
    )
    if model.cfg.attention == "mla":
        config = mla_draft_config(
            layer_config={
                k: v for k, v in model.cfg.layer_config.items() if k != "num_aux_hidden_states"
            },
            **common,
        )
    else:
        config = speculators_config(
            layer_config=model.cfg.layer_config,
            norm_before_fc=model.cfg.norm_before_fc,
            fc_norm=model.cfg.fc_norm,
            **common,
        )
    config["made_by"] = made_by("train")  # the code and versions that trained it
    write_draft_checkpoint(directory, model.checkpoint_state_dict(), config, inputs.d2t, inputs.t2d)


@torch.no_grad()
def only_in_draft_vocab(mb: MicroBatch, teacher: TeacherHead, device) -> MicroBatch:
    """``train.loss_positions: verifier_top1_in_draft_vocab``: the micro-batch with a loss mask
    left without the tokens whose teacher (the verifier at the position before) has its top-1
    over the whole vocabulary outside the draft vocabulary."""
    on_device = mb.to(device)
    top1 = Eagle3Draft.verifier_top1(on_device.final_hidden, on_device.loss_mask, teacher)
    mask = on_device.loss_mask.clone()
    mask[:, 1:] &= teacher.in_draft_vocab(top1[:, :-1])
    return dataclasses.replace(mb, loss_mask=mask.to(mb.loss_mask.device))


def with_aux_noise(mb: MicroBatch, amount: float) -> MicroBatch:
    """``train.aux_noise``: uniform noise in [-amount, amount] on the auxiliary states (drawn
    from the device's generator, whose state a resumed run restores)."""
    if amount == 0:
        return mb
    noise = torch.empty_like(mb.aux_hidden).uniform_(-amount, amount)
    return dataclasses.replace(mb, aux_hidden=mb.aux_hidden + noise)
