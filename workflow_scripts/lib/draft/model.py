"""The EAGLE-3 draft model and its training-time-test (TTT) loss, laid out as vLLM serves it.

The draft is a Llama decoder layer (or a Qwen3 one: the same with ``q_norm`` and ``k_norm``, an
RMSNorm over each query and key head before RoPE) that reads the verifier's features (names as in
the checkpoint; H = verifier hidden size, K = draft vocabulary, m = auxiliary layers):

    g      = fc(fc_norm(input_norm(concat(aux_1, ..., aux_m))))  # step 0: the features, [H]
    x      = concat(input_layernorm(embed(token)), hidden_norm(g))          # [2H]
    r      = hidden_norm(g) if norm_before_residual else g
    r      = r + self_attn(x)                              # q/k/v project 2H, RoPE
    r      = r + mlp(post_attention_layernorm(r))
    r      = r + self_attn_i(input_layernorm_i(r)); r = r + mlp_i(...)   # layers 1.. (optional)
    logits = lm_head(norm(r))                              # [K]
    g      = norm(r) if norm_output else r                 # fed back at the next step

With ``train.num_draft_layers`` above 1, the layers after the first are plain pre-norm Llama
layers on the residual stream r (q/k/v project H), each with its own keys, as vLLM's
``llama_eagle3.py`` serves ``layers.1..``.

input_norm (an RMSNorm over the m x H features) exists with ``norm_before_fc`` only, fc_norm (an
RMSNorm on each auxiliary state, m of them) with ``fc_norm`` only; those and ``norm_output`` are
EAGLE-3.1's options (speculators' and vLLM's readings of it), config keys of the checkpoint that
vLLM reads and applies in this order.

The loss of each trained position compares the teacher's distribution p with the draft's q over
the draft vocabulary (``train.loss``): the forward KL(p || q); the total variation 1 - alpha,
where alpha = sum_v min(p_v, q_v) is the acceptance rate of speculative sampling; -log alpha
(``lk_alpha``); or the LK hybrid lambda KL + (1 - lambda)(1 - alpha), lambda = exp(-eta alpha)
with alpha held constant in lambda (``lk_hybrid``; the LK losses SpecForge trains with: KL's
gradient while the draft is far off, acceptance's once it is close). ``Objective`` holds these
and two options on top: a top-K term (``topk_weight``: w x the cross-entropy over the teacher's K
most likely tokens, HASS's harmonized distillation) and the accepted chain (``chain``: at TTT
step k only the positions whose draft tokens of steps 0..k-1 all were the verifier's argmax, the
chain vLLM still extends under greedy decoding, as GRIFFIN's token alignment trains).

Alignment. A sample is tokens x_0..x_{T-1} with the verifier's states at every position. Draft
index t (0 <= t < T-1) at TTT step k:

    input     step 0: the verifier's features at position t;  step k: the draft's own r of step
              k-1 at index t;  token x_{t+1+k};  RoPE position t+k
    predicts  x_{t+2+k}; counted when x_{t+2+k} is loss-masked (an assistant token)
    teacher   the verifier's distribution at position t+1+k restricted to the draft vocabulary:
              softmax(lm_head_verifier[t2d] @ final_norm(h_N[t+1+k]))
    attends   the step-0 keys at indices 0..t and the keys of steps 1..k at index t (with a
              sliding window of W tokens, the step-0 keys from index t-(W-k)+1 only)

which is exactly what vLLM's proposer does: it feeds (x_{i+1}, features of i) at position i into
the draft's KV cache for the whole prefix, then drafts token k+1 at position t+k from its own
previous output, attending to the prefix and the k tokens drafted before. The TTT input tokens
are the data's (as in EAGLE-3), so the teacher distributions are conditioned on the same prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workflow_scripts.lib.draft.attention import dense_ttt_attention, ttt_attention
from workflow_scripts.lib.draft.layer_config import stacked
from workflow_scripts.lib.draft.greedy_walk import walk_steps
from workflow_scripts.lib.draft.layers import RMSNorm, Rotary, apply_rope
from workflow_scripts.lib.draft.objectives import Objective, objective_value
from workflow_scripts.lib.draft.teacher_head import LOSS_CHUNK_ELEMENTS, TeacherHead


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    verifier_vocab_size: int
    draft_vocab_size: int
    num_aux_layers: int = 3
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    norm_output: bool = False
    fc_norm: bool = False
    attention: str = "llama"  # or "mla": the verifier's multi-head latent attention (mla.py)
    num_layers: int = 1  # decoder layers; the first reads the embedding and the features
    qk_norm: bool = False  # the Qwen3 layer: an RMSNorm over each query and key head before RoPE
    sliding_window: int | None = None  # tokens every layer's queries see, their own included
    layer_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_layer_config(
        cls,
        layer_config: dict[str, Any],
        draft_vocab_size: int,
        num_aux_layers: int = 3,
        norm_before_residual: bool = True,
        norm_before_fc: bool = False,
        norm_output: bool = False,
        attention: str = "llama",
        fc_norm: bool = False,
        num_layers: int = 1,
        sliding_window: int | None = None,
    ) -> "DraftConfig":
        c = layer_config
        layer_config = stacked(layer_config, num_layers, sliding_window)
        return cls(
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            rms_norm_eps=c["rms_norm_eps"],
            verifier_vocab_size=c["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            num_aux_layers=num_aux_layers,
            norm_before_residual=norm_before_residual,
            norm_before_fc=norm_before_fc,
            norm_output=norm_output,
            fc_norm=fc_norm,
            attention=attention,
            num_layers=num_layers,
            qk_norm=c.get("model_type") == "qwen3",
            sliding_window=sliding_window,
            layer_config=layer_config,
        )


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, first: bool = True, window: int | None = None):
        super().__init__()
        self.window = window  # a sliding window (attention.py), or None
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        # the first layer: the embedding and the features, side by side; later ones: the stream
        width = 2 * cfg.hidden_size if first else cfg.hidden_size
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.dense = False  # True: the quadratic reference attention (tests, benchmark)

    def forward(self, x, cos, sin, cache: list[tuple[torch.Tensor, torch.Tensor]]):
        """x: [B, n, 2H]. ``cache`` holds the (k, v) of the earlier TTT steps; this step's are
        appended, and the queries attend to the step-0 keys causally and to their own position's
        keys of the later steps (``attention.py``)."""
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:  # the Qwen3 layer
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.append((k, v))
        out = (dense_ttt_attention if self.dense else ttt_attention)(q, cache, window=self.window)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, first: bool = True, window: int | None = None):
        super().__init__()
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not first:  # vLLM builds it in every layer and reads it only in the first: kept at 1
            self.hidden_norm.weight.requires_grad_(False)
        if cfg.attention == "mla":
            from workflow_scripts.lib.draft.mla import MLAAttention, MLARotary

            rope = MLARotary(
                cfg.layer_config["qk_rope_head_dim"], cfg.layer_config["rope_parameters"]
            )
            self.self_attn = MLAAttention(cfg, cfg.layer_config, rope.attention_mscale)
        else:
            self.self_attn = Attention(cfg, first, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, g, cos, sin, cache):
        """The first layer: embeds, g [B, n, H] -> its output r [B, n, H] (before the final
        norm); a later layer: g is the stream r of the layer before (embeds unused)."""
        if self.first:
            normed = self.hidden_norm(g)
            residual = normed if self.norm_before_residual else g
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, x = g, self.input_layernorm(g)
        r = residual + self.self_attn(x, cos, sin, cache)
        return r + self.mlp(self.post_attention_layernorm(r))


# --------------------------------------------------------------------------- the draft

# per TTT step, summed over positions: the forward KL; draft top-1 = teacher top-1 inside the draft
# vocabulary ("correct"); counted positions; draft top-1 = the verifier's argmax over its whole
# vocabulary ("served": what vLLM accepts under greedy decoding); anchors whose draft tokens up to
# this step were all accepted ("accepted": vLLM's chain); the anchors (step-0 positions); where
# asked, greedy decoding's count at k = this step + 1 (greedy_walk.py: its steps, drafts accepted)
STAT_KEYS = ("kl", "correct", "count", "served", "accepted", "anchors")
STAT_KEYS += ("walk_steps", "walk_accepted")


class Eagle3Draft(nn.Module):
    """Parameter names are the checkpoint's (speculators format); ``embed_tokens`` is the
    verifier's, frozen (not in the training state; in the checkpoint)."""

    def __init__(self, cfg: DraftConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.verifier_vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.num_aux_layers * H, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(
                [RMSNorm(H, cfg.rms_norm_eps) for _ in range(cfg.num_aux_layers)]
            )
        self.fc = nn.Linear(cfg.num_aux_layers * H, H, bias=False)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i == 0, cfg.sliding_window) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        if cfg.attention == "mla":
            from workflow_scripts.lib.draft.mla import MLARotary

            layer = cfg.layer_config
            self.rotary = MLARotary(layer["qk_rope_head_dim"], layer["rope_parameters"])
        else:
            self.rotary = Rotary(cfg.layer_config)
        self.reset_parameters()
        if embed_weight is not None:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(embed_weight)

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What training changes (and a training state stores): all but the embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """What the draft checkpoint stores: everything, the verifier's embedding included."""
        return {**self.trainable_state_dict(), "embed_tokens.weight": self.embed_tokens.weight}

    def unroll(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int):
        """The draft's outputs r for every TTT step: a list of ``ttt_steps`` tensors [B, n, H].

        aux_hidden: [B, L, m, H] verifier auxiliary states; input_ids: [B, L]; n = L - 1.
        """
        B, L = input_ids.shape
        n = L - 1
        features = aux_hidden[:, :n].flatten(2)
        if self.cfg.norm_before_fc:
            features = self.input_norm(features)
        if self.cfg.fc_norm:
            chunks = features.chunk(self.cfg.num_aux_layers, dim=-1)
            features = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        g = self.fc(features)
        positions = torch.arange(n, device=input_ids.device)
        caches: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        outputs = []
        for k in range(ttt_steps):
            embeds = self.embed_tokens(shift_left(input_ids, 1 + k, n)).to(g.dtype)  # x_{t+1+k}
            cos, sin = self.rotary(positions + k)
            r = g
            for layer, cache in zip(self.layers, caches):
                r = layer(embeds, r, cos, sin, cache)
            outputs.append(r)
            g = self.norm(r) if self.cfg.norm_output else r
        return outputs

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [B, L, m, H]
        final_hidden: torch.Tensor,  # [B, L, H]
        input_ids: torch.Tensor,  # [B, L] int64 (padding: anything)
        loss_mask: torch.Tensor,  # [B, L] bool (padding: False)
        teacher: TeacherHead,
        ttt_steps: int,
        step_loss_decay: float = 1.0,
        denominators: list[float] | None = None,
        objective: Objective = Objective(),
        walk: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The TTT loss: sum over steps k of decay**k * (sum of the step's ``objective``: kl, tv,
        lk_alpha or lk_hybrid, plus its top-K term, over the positions it trains: see
        ``Objective``) divided by ``denominators[k]`` (the number of counted positions of step k
        in the whole global batch, so that any split of a batch over micro-batches and processes
        gives the same gradient; by default this micro-batch's own count). With
        ``objective.chain`` a position whose chain broke before step k adds nothing at step k
        (the denominator stays: step k's weight is the share of chains that reach it).

        Returns the loss and summed statistics per step (``STAT_KEYS``, each [S]). ``accepted``
        follows vLLM's greedy acceptance: an anchor (a position counted at step 0) has its draft
        token of step k accepted if those of steps 0..k all equal the verifier's argmax over its
        whole vocabulary. (The unroll feeds the data's tokens: this is vLLM's chain exactly when
        the answers are the verifier's own greedy ones, as regeneration makes them.) With
        ``walk``, also greedy decoding's count over the same chains (``walk_steps``).
        """
        outputs = self.unroll(aux_hidden, input_ids, ttt_steps)
        n = input_ids.shape[1] - 1
        mask = loss_mask.bool()
        rows = max(1, LOSS_CHUNK_ELEMENTS // self.cfg.draft_vocab_size)
        verifier_top1 = self.verifier_top1(final_hidden, mask, teacher)

        loss = outputs[0].new_zeros((), dtype=torch.float32)
        stats = {key: torch.zeros(ttt_steps, dtype=torch.float64) for key in STAT_KEYS}
        alive = shift_left(mask, 2, n)  # the anchors; then those whose chain still holds
        anchors = int(alive.sum())
        chains = []  # alive after each step
        for k, r in enumerate(outputs):
            counted = shift_left(mask, 2 + k, n)  # x_{t+2+k} is an assistant token
            b, t = counted.nonzero(as_tuple=True)
            served = torch.zeros_like(counted)
            kl_sum, objective_sum, correct = loss.new_zeros(()), loss.new_zeros(()), 0
            trained = alive if objective.chain and k > 0 else None  # the chains that hold
            for i in range(0, len(b), rows):  # [rows, K] logits at a time, recomputed backward
                bb, tt = b[i : i + rows], t[i : i + rows]
                weight = None if trained is None else trained[bb, tt]
                kl, value, right, top1 = checkpoint(
                    self.chunk_loss, r[bb, tt], final_hidden[bb, tt + 1 + k], teacher,
                    objective, weight, use_reentrant=False,
                )  # fmt: skip
                kl_sum, correct = kl_sum + kl.detach(), correct + int(right)
                objective_sum = objective_sum + value
                served[bb, tt] = teacher.draft_to_verifier[top1] == verifier_top1[bb, tt + 1 + k]
            denominator = denominators[k] if denominators is not None else max(len(b), 1)
            loss = loss + step_loss_decay**k * objective_sum / max(denominator, 1)
            alive &= served
            stats["kl"][k] = kl_sum.detach().double().cpu()
            stats["correct"][k] = correct
            stats["count"][k] = len(b)
            stats["served"][k] = int(served.sum())
            stats["accepted"][k] = int(alive.sum())
            stats["anchors"][k] = anchors
            if walk:
                chains.append(alive.clone())
        if walk:
            stats["walk_steps"], stats["walk_accepted"] = walk_steps(shift_left(mask, 2, n), chains)
        return loss, stats

    @staticmethod
    def verifier_top1(final_hidden, mask, teacher: TeacherHead) -> torch.Tensor:
        """[B, L] the verifier's argmax over its whole vocabulary at every position the loss
        reads (j where x_{j+1} is an assistant token), -1 elsewhere."""
        read = shift_left(mask, 1, mask.shape[1])
        b, j = read.nonzero(as_tuple=True)
        top1 = torch.full(mask.shape, -1, dtype=torch.int64, device=mask.device)
        top1[b, j] = teacher.verifier_top1(final_hidden[b, j])
        return top1

    def chunk_loss(
        self,
        draft_states,
        teacher_states,
        teacher: TeacherHead,
        objective: Objective = Objective(),
        weight: torch.Tensor | None = None,
    ):
        """Over a chunk of positions, summed: the forward KL(teacher || draft), the ``objective``
        (the KL itself, or tv, lk_alpha, lk_hybrid, with its top-K term; each position times
        ``weight`` [c] where given); the number of top-1 agreements inside the draft vocabulary,
        and the draft's top-1 (draft ids). draft_states [c, H] (the layer's output r),
        teacher_states [c, H] (the verifier's final states where the predicted tokens sit)."""
        target = teacher.log_probs(teacher_states)
        draft_lp = F.log_softmax(self.lm_head(self.norm(draft_states)).float(), dim=-1)
        p = target.exp()
        kl = (p * (target - draft_lp)).sum(-1)
        q = None if objective.name == "kl" else draft_lp.exp()  # the KL needs no q of its own
        value = objective_value(objective.name, kl, p, q, objective.lk_eta)
        if objective.topk_weight > 0:
            top = p.topk(min(objective.topk, p.shape[-1]), dim=-1).indices
            head = (p.gather(-1, top) * draft_lp.gather(-1, top)).sum(-1)
            value = value - objective.topk_weight * head
        if weight is not None:
            value = value * weight.to(value.dtype)
        with torch.no_grad():
            top1 = draft_lp.argmax(-1)
            right = (top1 == target.argmax(-1)).sum()
        return kl.sum(), value.sum(), right, top1


def shift_left(x: torch.Tensor, by: int, n: int) -> torch.Tensor:
    """x[:, by : by+n], padded on the right with zeros (False) to length n."""
    out = x[:, by : by + n]
    if out.shape[1] < n:
        out = torch.cat([out, out.new_zeros(x.shape[0], n - out.shape[1])], dim=1)
    return out


def param_count(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
