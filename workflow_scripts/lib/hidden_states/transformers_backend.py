"""Extraction's reference backend: Hugging Face transformers, one sample per forward pass; aux id k
is ``hidden_states[k]`` (the input of decoder layer k) and the final state is the input of the
final norm (a pre-hook on it); the teacher check's top-1 from the model's own logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from workflow_scripts.lib.hidden_states.shard_writer import ShardJob
from workflow_scripts.lib.verifier.engine import cpu_threads


class TransformersExtractor:
    """The reference backend: Hugging Face transformers, one sample per forward pass."""

    def __init__(self, verifier: Path, dtype: torch.dtype, aux_ids: list[int], use_gpus: bool):
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": dtype}
        if use_gpus:
            kwargs["device_map"] = "auto"
        else:
            torch.set_num_threads(cpu_threads())
        self.model = AutoModelForCausalLM.from_pretrained(str(verifier), **kwargs).eval()
        self.base = self.model.get_decoder()
        norm = next(
            (
                getattr(self.base, n)
                for n in ("norm", "final_layernorm", "ln_f")
                if hasattr(self.base, n)
            ),
            None,
        )
        if norm is None:
            raise RuntimeError(
                f"{type(self.base).__name__} has no final norm (norm / final_layernorm / ln_f) "
                "to take the final pre-norm state from"
            )
        self.aux_ids = aux_ids
        self._captured: dict[str, torch.Tensor] = {}
        norm.register_forward_pre_hook(self._hook)
        self.device = next(self.model.parameters()).device

    def _hook(self, _module, args):
        self._captured["final"] = args[0]

    @torch.inference_mode()
    def top1(self, ids: torch.Tensor, check: dict[str, Any]) -> list[int]:
        """The verifier's top-1 at the checked positions, from its own logits."""
        logits = self.model(input_ids=ids[None, : check["tokens"]].to(self.device)).logits[0]
        return logits.argmax(-1)[check["positions"]].cpu().tolist()

    @torch.inference_mode()
    def states(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.base(input_ids=ids[None].to(self.device), output_hidden_states=True)
        aux = torch.stack([out.hidden_states[k][0] for k in self.aux_ids], dim=1)
        return aux.cpu(), self._captured.pop("final")[0].cpu()

    def run(
        self,
        jobs: Iterable[ShardJob],
        hidden_size: int,
        storage: torch.dtype,
        on_sample: Callable[[int], None],
        on_shard: Callable[[ShardJob], None],
    ) -> None:
        for job in jobs:
            writer = job.open(len(self.aux_ids), hidden_size, storage)
            check = job.extra.get("check")
            if check:
                top1 = self.top1(job.samples[check["sample"]][0], check)
                job.extra["teacher_check"] = {**check, "top1": top1}
            for i, (ids, _) in enumerate(job.samples):
                aux, final = self.states(ids)
                writer.put(i, aux, final)
                on_sample(int(ids.numel()))
            on_shard(job)
