"""The training loop: AdamW, linear warm-up then cosine decay, gradient clipping; bf16 autocast on
GPUs, float32 on the CPU; DDP over the processes. A global batch is ``processes x
grad_accum_steps`` micro-batches and the loss is normalised by its global counts, so one process
with 2 accumulation steps and two processes with 1 train the same model.

Every ``checkpoint_every_steps`` it writes ``<state_dir>/state.pt`` atomically (weights,
optimizer, scheduler, RNG, step); every ``validate_every_steps`` and at the end it scores the
held-out split. Neither changes the training: the draft is the same whatever the checkpoint
cadence. A killed run resumes there and repeats the uninterrupted run's
steps exactly. A state from other settings or inputs is discarded, never resumed. Loss, per-TTT
step top-1 agreement, tokens/s and ETA go to the log; one JSONL row per step (and per
validation) to the metrics file, and to TensorBoard and W&B with ``train.report_to``
(``reporting.py``). At the end it writes the draft checkpoint (speculators format, see
``draft/checkpoint.py``) and the metrics, atomically.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from workflow_scripts.lib.common import UserError, atomic_path, format_seconds
from workflow_scripts.lib.draft.model import STAT_KEYS, Objective, param_count
from workflow_scripts.lib.hidden_states import shards
from workflow_scripts.lib.training import reporting, teacher_check
from workflow_scripts.lib.training.loader import (
    Loader,
    Plan,
    StepData,
    collate,
    pack_micro_batches,
    split_samples,
)
from workflow_scripts.lib.training.inputs import Inputs
from workflow_scripts.lib.training.processes import Dist
from workflow_scripts.lib.training.build import (
    build_draft,
    fmt_list,
    gpu_memory,
    lr_factor,
    make_optimizer,
    only_in_draft_vocab,
    summarize,
    with_aux_noise,
    write_draft,
)
from workflow_scripts.lib.training.stream_consumer import Stream
from workflow_scripts.lib.workflow.definitions import TrainParams
from workflow_scripts.lib.workflow.layout import METRICS
from workflow_scripts.lib.workflow.records import MetricsRow
from workflow_scripts.lib.workflow.registry import TrainIO

log = logging.getLogger("eagle3")

STATE_FILE = "state.pt"
BEST_FILE = "best.pt"  # the weights of the best validation so far
BEST_META = "best.json"  # which validation that is (step, score, summary)


class Trainer:
    def __init__(self, io: TrainIO, p: TrainParams, inputs: Inputs, d: Dist):
        self.io, self.p, self.inputs, self.d = io, p, inputs, d
        self.state_dir = Path(io.state_dir)
        on_gpu = d.device.type == "cuda"
        self.autocast = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
            if on_gpu
            else contextlib.nullcontext
        )
        self.data_dtype = shards.TORCH_DTYPES[inputs.manifest.dtype] if on_gpu else torch.float32

        model, teacher = build_draft(inputs, p, embed_dtype=None if on_gpu else torch.float32)
        self.model, self.teacher = model.to(d.device), teacher.to(d.device)
        if not inputs.streamed:  # streamed: once the engine has written the first shard
            teacher_check.verify_and_log(inputs.manifest, self.teacher, d, io.verifier)
        cfg = self.model.cfg
        if d.distributed:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[d.local_rank] if on_gpu else None,
                broadcast_buffers=False,
            )
        else:
            self.ddp = self.model
        self.optimizer = make_optimizer(self.model, p)

        # the data
        train_ids, self.val_ids = split_samples(len(inputs.index), p.validation_fraction, p.seed)
        self.plan = Plan(
            train_ids,
            inputs.index.lengths,
            p.micro_batch_budget_tokens,
            p.seed,
            p.epochs,
            d.world * p.grad_accum_steps,
            shard_of=inputs.index.shard_of,
            window=p.shuffle_window_shards,
        )
        self.stream = (
            Stream(io, p, inputs.index, self.plan, self.val_ids, d) if inputs.streamed else None
        )
        if self.plan.total_steps == 0:
            raise UserError(
                f"the training split ({len(train_ids)} samples) does not fill one global batch of "
                f"{d.world * p.grad_accum_steps} micro-batches (processes x grad_accum_steps); "
                "lower train.micro_batch_budget_tokens or grad_accum_steps, or add data"
            )
        total = self.plan.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, p.warmup_steps, total, p.min_lr_ratio, p.lr_schedule),
        )
        self.step = 0
        self.serve_k = min(p.num_speculative_tokens, p.ttt_steps)
        self.objective = Objective(
            p.loss, p.lk_eta, p.topk_loss_weight, p.topk_loss_k, p.ttt_positions == "accepted_chain"
        )
        self.best: dict[str, Any] | None = None  # step, score and summary of the best validation
        self.run_id, self.report = reporting.new_run_id(), None  # the curves' run (reporting.py)
        if d.main:
            log.info(
                "draft: %s trainable parameters; verifier hidden %d, %d aux layers %s, draft vocab "
                "%d of %d; %d training / %d held-out samples; %d steps (%s per epoch), %d "
                "micro-batches of <= %d tokens per step over %d process(es) on %s",
                f"{param_count(self.model):,}",
                cfg.hidden_size,
                cfg.num_aux_layers,
                inputs.aux_layer_ids,
                cfg.draft_vocab_size,
                cfg.verifier_vocab_size,
                len(train_ids),
                len(self.val_ids),
                total,
                self.plan.steps_per_epoch[0],
                self.plan.micro_per_step,
                p.micro_batch_budget_tokens,
                d.world,
                d.device.type,
            )

    # ---- resume state

    def save_state(self) -> None:
        rng = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if self.d.device.type == "cuda" else None,
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        rngs = [None] * self.d.world
        if self.d.distributed:
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        if self.d.main:
            state = {
                "fingerprint": self.inputs.fingerprint,
                "step": self.step,
                "model": {k: v.cpu() for k, v in self.model.trainable_state_dict().items()},
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": rngs,
                "report_run": self.run_id,
            }
            with atomic_path(self.state_dir / STATE_FILE) as tmp:
                torch.save(state, tmp)
            log.info("checkpoint: step %d saved to %s", self.step, self.state_dir / STATE_FILE)
        self.d.barrier()

    def restore_state(self) -> None:
        path = self.state_dir / STATE_FILE
        if not path.exists():
            if self.d.main:
                reporting.keep_rows(self.state_dir / METRICS, -1)
                self._forget_best()
            self.d.barrier()
            return
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state.get("fingerprint") != self.inputs.fingerprint:
            self.d.barrier()
            if self.d.main:
                log.warning(
                    "%s was saved by a run with other settings or inputs: starting from scratch",
                    path,
                )
                path.unlink()
                reporting.keep_rows(self.state_dir / METRICS, -1)
                self._forget_best()
            self.d.barrier()
            return
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
            raise UserError(f"{path} does not fit this model; delete it to start over")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng = state["rng"][self.d.rank]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and self.d.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        self.step = int(state["step"])
        self.run_id = state.get("report_run", self.run_id)
        best = self.state_dir / BEST_META
        if best.exists():
            self.best = json.loads(best.read_text())
            if (
                self.best.get("fingerprint") != self.inputs.fingerprint
                or self.best["step"] > self.step
            ):
                self.best = None  # from other settings, or past the resumed step: made again
        if self.d.main:
            reporting.keep_rows(self.state_dir / METRICS, self.step)
            log.info("resumed from %s at step %d of %d", path, self.step, self.plan.total_steps)
        self.d.barrier()

    def _forget_best(self) -> None:
        for name in (BEST_FILE, BEST_META):
            (self.state_dir / name).unlink(missing_ok=True)

    def keep_if_best(self, summary: dict[str, Any]) -> None:
        """Keep the weights of the best validation by ``train.select_by`` (the highest simulated
        acceptance length, or the lowest KL; the latest of equal ones), in ``best.pt`` beside
        the state."""
        if self.p.select_by == "simulated_acceptance":
            score = summary["simulated_acceptance_length"]
        else:
            score = -summary["loss"]
        if self.best is not None and score < self.best["score"]:
            return
        self.best = {
            "fingerprint": self.inputs.fingerprint,
            "step": self.step,
            "score": score,
            "summary": summary,
        }
        if self.d.main:
            weights = {k: v.cpu() for k, v in self.model.trainable_state_dict().items()}
            with atomic_path(self.state_dir / BEST_FILE) as tmp:
                torch.save(weights, tmp)
            with atomic_path(self.state_dir / BEST_META) as tmp:
                tmp.write_text(json.dumps(self.best))
        self.d.barrier()

    def write_metrics(self, row: MetricsRow) -> None:
        if self.d.main:
            reporting.append_row(self.state_dir / METRICS, row)
            if self.report is not None:
                self.report.log(row)

    # ---- steps

    def train_step(self, data: StepData) -> tuple[torch.Tensor, float]:
        """One optimizer step over this process's micro-batches; returns summed stats and the
        gradient norm."""
        p, S = self.p, self.p.ttt_steps
        if p.loss_positions == "verifier_top1_in_draft_vocab":
            data.micro_batches = [
                only_in_draft_vocab(mb, self.teacher, self.d.device) for mb in data.micro_batches
            ]
        # the loss is a mean over the whole global batch: its counts, summed over processes
        local = [sum(c) for c in zip(*(mb.counted_positions(S) for mb in data.micro_batches))]
        denominators = self.d.all_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        stats = torch.zeros(len(STAT_KEYS), S, dtype=torch.float64)
        for i, mb in enumerate(data.micro_batches):
            mb = with_aux_noise(mb.to(self.d.device, non_blocking=True), p.aux_noise)
            last = i == len(data.micro_batches) - 1
            sync = (
                contextlib.nullcontext() if last or not self.d.distributed else self.ddp.no_sync()
            )
            with sync:
                with self.autocast():
                    loss, s = self.ddp(
                        mb.aux_hidden,
                        mb.final_hidden,
                        mb.input_ids,
                        mb.loss_mask,
                        self.teacher,
                        S,
                        p.ttt_step_loss_decay,
                        denominators,
                        self.objective,
                    )
                # DDP averages gradients over processes; the loss is already a global mean
                (loss * self.d.world).backward()
            stats += torch.stack([s[k] for k in STAT_KEYS])
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [q for q in self.model.parameters() if q.requires_grad], p.grad_clip_norm
        )
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats, float(grad_norm)

    @torch.no_grad()
    def validate(self) -> dict[str, Any] | None:
        if len(self.val_ids) == 0:
            return None
        batches = pack_micro_batches(
            self.val_ids, self.inputs.index.lengths, self.p.micro_batch_budget_tokens, None
        )
        S = self.p.ttt_steps
        stats = torch.zeros(len(STAT_KEYS), S, dtype=torch.float64)
        for ids in batches[self.d.rank :: self.d.world]:
            mb = collate([self.inputs.index.sample(int(g)) for g in ids], self.data_dtype)
            mb = mb.to(self.d.device)
            with self.autocast():
                states = (mb.aux_hidden, mb.final_hidden, mb.input_ids, mb.loss_mask)
                _, s = self.model(*states, self.teacher, S, walk=True)  # greedy decoding's too
            stats += torch.stack([s[k] for k in STAT_KEYS])
        summary = summarize(self.d.all_sum(stats), self.p.ttt_step_loss_decay, self.serve_k)
        self.write_metrics(MetricsRow(step=self.step, split="val", **summary))
        if self.d.main:
            log.info(
                "validation at step %d: loss %.4f, top-1 agreement per TTT step %s (%d positions)",
                self.step,
                summary["loss"],
                fmt_list(summary["top1_agreement"]),
                summary["positions_per_step"][0],
            )
        return summary

    def run(self) -> None:
        ok = False
        try:
            self._run()
            ok = True
        finally:
            if self.stream is not None:
                self.stream.stop()
            if self.report is not None:
                self.report.close(ok)

    def _run(self) -> None:
        p, d = self.p, self.d
        self.restore_state()
        if d.main and p.report_to:  # beside the metrics output: <results_dir>/train
            rows = reporting.read_rows(self.state_dir / METRICS)
            root = Path(self.io.metrics).parent
            self.report = reporting.Reporter(p, root, self.run_id, self.step, rows)
        if self.stream is not None:
            self.stream.start(self.step, self.teacher)
        total = self.plan.total_steps
        loader = Loader(
            self.inputs.index,
            self.plan,
            self.step,
            total,
            d.rank,
            p.grad_accum_steps,
            self.data_dtype,
            pin=d.device.type == "cuda",
            background=d.device.type == "cuda",
        )
        started = last = time.monotonic()
        first_step = self.step
        window_start, window_tokens = started, 0
        for data in loader:
            stats, grad_norm = self.train_step(data)
            self.step += 1
            tokens = sum(mb.num_tokens for mb in data.micro_batches)
            totals = d.all_sum(
                torch.cat([stats.flatten(), torch.tensor([float(tokens)], dtype=torch.float64)])
            )
            stats, tokens = totals[:-1].view(len(STAT_KEYS), p.ttt_steps), int(totals[-1])
            summary = summarize(stats, p.ttt_step_loss_decay, self.serve_k)
            now = time.monotonic()
            window_tokens += tokens
            done = self.step - first_step
            eta = (now - started) / done * (total - self.step)
            row = MetricsRow(
                step=self.step,
                split="train",
                epoch=self.plan.locate(self.step - 1)[0],
                **summary,
                lr=self.lr,
                grad_norm=grad_norm,
                tokens=tokens,
                tokens_per_s=round(tokens / max(now - last, 1e-9), 1),
                elapsed_s=round(now - started, 3),
                eta_s=round(eta, 1),
            )
            last = now
            self.write_metrics(row)
            if d.main and (done == 1 or self.step % p.log_every_steps == 0 or self.step == total):
                log.info(
                    "step %d/%d epoch %d: loss %.4f, top-1 agreement per TTT step %s, lr %.2e, "
                    "%.0f tokens/s, ETA %s%s",
                    self.step,
                    total,
                    row.epoch + 1,
                    summary["loss"],
                    fmt_list(summary["top1_agreement"]),
                    row.lr,
                    window_tokens / max(now - window_start, 1e-9),
                    format_seconds(eta),
                    gpu_memory(d.device),
                )
                window_start, window_tokens = now, 0
            # validation before the state is saved: a state at step s has every row up to s
            if self.step % p.validate_every_steps == 0 or self.step == total:
                summary = self.validate()
                if summary is not None:
                    self.keep_if_best(summary)
            if self.step % p.checkpoint_every_steps == 0 and self.step < total:
                self.save_state()
            if self.stream is not None:
                self.stream.after_step(self.step)
        self.save_state()
        if d.main:
            self.write_outputs()
        d.barrier()

    def write_outputs(self) -> None:
        """The draft (the best validation's weights; the last step's without a held-out split)
        and the metrics, ending with a ``selected`` row: the validation the draft is from."""
        metrics = (self.state_dir / METRICS).read_bytes()
        if self.best is not None:
            if self.best["step"] != self.step:
                weights = torch.load(self.state_dir / BEST_FILE, map_location="cpu")
                self.model.load_state_dict(weights, strict=False)
            row = MetricsRow(step=self.best["step"], split="selected", **self.best["summary"])
            metrics += row.line().encode()
            if self.report is not None:
                self.report.summary(row)
            summary, k = self.best["summary"], self.serve_k
            log.info(
                "the draft is step %d's: simulated acceptance length %.3f at k=%d (%.3f as greedy "
                "decoding counts it), KL %.4f on the held-out split (the best validation by %s)",
                self.best["step"],
                summary["simulated_acceptance_length"],
                k,
                (summary.get("walked_acceptance_by_k") or [float("nan")] * k)[k - 1],
                summary["loss"],
                self.p.select_by,
            )
        write_draft(self.io.draft, self.model, self.inputs, self.io, self.p)
        with atomic_path(self.io.metrics) as tmp:
            tmp.write_bytes(metrics)
        log.info("draft checkpoint written to %s, metrics to %s", self.io.draft, self.io.metrics)
