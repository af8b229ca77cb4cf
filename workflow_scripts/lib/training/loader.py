"""Training's data: samples streamed from the memory-mapped shards in a deterministic order
(seeded per epoch), packed into padded micro-batches of at most ``micro_batch_budget_tokens``,
and a seeded held-out split. Any step's data can be recomputed from the seed, so a resumed run
repeats the uninterrupted run's steps exactly.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.hidden_states import shards
from workflow_scripts.lib.hidden_states.records import Manifest

PACK_WINDOW_SAMPLES = 256  # samples sorted by length together when packing micro-batches


class SampleIndex:
    """Every sample's shard, place and length; samples are read from the memory-mapped shards
    only when a micro-batch needs them."""

    def __init__(self, manifest: Manifest, aux_order: list[int] | None, max_tokens: int):
        self.aux_order = aux_order
        self.max_tokens = max_tokens
        self.readers, shard_of, local_of, lengths = [], [], [], []
        n_aux, H = len(manifest.aux_layer_ids), manifest.hidden_size
        storage = manifest.storage_dtype
        for i, entry in enumerate(manifest.shards):
            try:
                reader = shards.ShardReader(Path(entry.path))
                first = reader.sample(0)
            except Exception as exc:
                raise UserError(f"shard {entry.path} is unreadable: {exc}") from None
            n = first.num_tokens
            if reader.storage_dtype != shards.SAFETENSORS_DTYPES[shards.TORCH_DTYPES[storage]]:
                raise UserError(
                    f"shard {entry.path} stores its states as {reader.storage_dtype}, the "
                    f"manifest says {storage}: it comes from another extraction run; rerun "
                    "extraction"
                )
            aux_shape = list(first.aux_hidden_states.shape)
            final_shape = list(first.final_hidden_states.shape)
            if (
                len(reader) != entry.num_samples
                or aux_shape != [n, n_aux, H]
                or final_shape != [n, H]
            ):
                raise UserError(
                    f"shard {entry.path} does not hold what the manifest says ({len(reader)} "
                    f"samples, first sample: aux {aux_shape}, final {final_shape}; manifest: "
                    f"{entry.num_samples} samples, {n_aux} aux layers, hidden size {H})"
                )
            self.readers.append(reader)
            shard_of.append(np.full(len(reader), i, dtype=np.int64))
            local_of.append(np.arange(len(reader), dtype=np.int64))
            lengths.append(reader.lengths().numpy())
        self.shard_of = np.concatenate(shard_of)
        self.local_of = np.concatenate(local_of)
        self.full_lengths = np.concatenate(lengths)
        self.lengths = np.minimum(self.full_lengths, max_tokens)  # longer samples are cut

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, g: int) -> shards.SampleStates:
        """Sample g, cut to ``max_tokens``, its states decoded (float8 shards: to float32)."""
        s = self.readers[self.shard_of[g]].sample(int(self.local_of[g]), int(self.lengths[g]))
        if self.aux_order is not None:
            s.aux_hidden_states = s.aux_hidden_states[:, self.aux_order]
        return s


def split_samples(num_samples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids), both sorted; the same seed gives the same split."""
    perm = np.random.default_rng([seed, 1]).permutation(num_samples)
    n_val = int(round(fraction * num_samples))
    if fraction > 0 and n_val == 0 and num_samples > 1:
        n_val = 1
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def pack_micro_batches(
    ids: np.ndarray, lengths: np.ndarray, budget: int, rng: np.random.Generator | None
) -> list[np.ndarray]:
    """Micro-batches of samples with rows x longest <= budget tokens. With ``rng``: shuffled,
    then sorted by length within windows (little padding) and the batches shuffled again."""
    order = rng.permutation(ids) if rng is not None else np.asarray(ids)
    batches: list[np.ndarray] = []
    for w in range(0, len(order), PACK_WINDOW_SAMPLES):
        chunk = order[w : w + PACK_WINDOW_SAMPLES]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        start, longest = 0, 0
        for j, g in enumerate(chunk):
            longest_with = max(longest, int(lengths[g]))
            if j > start and longest_with * (j - start + 1) > budget:
                batches.append(chunk[start:j])
                start, longest_with = j, int(lengths[g])
            longest = longest_with
        batches.append(chunk[start:])
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


class Plan:
    """The deterministic sequence of global batches: epoch e's order depends on (seed, e) only,
    so any step's data can be recomputed on resume. A global batch is ``micro_per_step``
    consecutive micro-batches; an epoch's leftover micro-batches are dropped.

    With ``window`` (train.shuffle_window_shards) and ``shard_of`` (every sample's shard), an
    epoch takes the shards in a seeded order, ``window`` at a time, and packs and shuffles only
    their samples together: a shard is read within one window's steps of each epoch."""

    def __init__(
        self,
        train_ids,
        lengths,
        budget: int,
        seed: int,
        epochs: int,
        micro_per_step: int,
        shard_of: np.ndarray | None = None,
        window: int | None = None,
    ):
        self.train_ids, self.lengths, self.budget, self.seed = train_ids, lengths, budget, seed
        self.micro_per_step = micro_per_step
        self.shard_of, self.window = shard_of, window
        self.steps_per_epoch = [len(self._micro(e)) // micro_per_step for e in range(epochs)]
        self.total_steps = sum(self.steps_per_epoch)
        self._cached: tuple[int, list[np.ndarray]] | None = None

    def _micro(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, 2, epoch])
        if self.window is None:
            return pack_micro_batches(self.train_ids, self.lengths, self.budget, rng)
        train_shards = self.shard_of[self.train_ids]
        order = np.random.default_rng([self.seed, 3, epoch]).permutation(np.unique(train_shards))
        batches: list[np.ndarray] = []
        for w in range(0, len(order), self.window):
            ids = self.train_ids[np.isin(train_shards, order[w : w + self.window])]
            batches += pack_micro_batches(ids, self.lengths, self.budget, rng)
        return batches

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of a global step."""
        for epoch, n in enumerate(self.steps_per_epoch):
            if step < n:
                return epoch, step
            step -= n
        raise IndexError(step)

    def global_batch(self, step: int) -> list[np.ndarray]:
        epoch, i = self.locate(step)
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self._micro(epoch))
        return self._cached[1][i * self.micro_per_step : (i + 1) * self.micro_per_step]


@dataclass
class MicroBatch:
    aux_hidden: torch.Tensor  # [B, L, m, H]
    final_hidden: torch.Tensor  # [B, L, H]
    input_ids: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L] bool
    num_tokens: int  # real (unpadded) tokens

    def _map(self, fn) -> "MicroBatch":
        tensors = (self.aux_hidden, self.final_hidden, self.input_ids, self.loss_mask)
        return MicroBatch(*(fn(t) for t in tensors), self.num_tokens)

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "MicroBatch":
        return self._map(lambda t: t.pin_memory())

    def counted_positions(self, ttt_steps: int) -> list[int]:
        """Positions counted at each TTT step (padding is never masked, so no lengths needed)."""
        return [int(self.loss_mask[:, 2 + k :].sum()) for k in range(ttt_steps)]


def collate(samples: list[shards.SampleStates], dtype: torch.dtype) -> MicroBatch:
    """Samples -> one right-padded micro-batch (padding: zero states, token 0, never counted)."""
    B, L = len(samples), max(s.num_tokens for s in samples)
    n_aux, H = samples[0].aux_hidden_states.shape[1:]
    aux = torch.empty(B, L, n_aux, H, dtype=dtype)
    final = torch.empty(B, L, H, dtype=dtype)
    ids = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = s.num_tokens
        aux[i, :n] = s.aux_hidden_states
        aux[i, n:] = 0
        final[i, :n] = s.final_hidden_states
        final[i, n:] = 0
        ids[i, :n] = s.input_ids
        mask[i, :n] = s.loss_mask.bool()
    return MicroBatch(aux, final, ids, mask, sum(s.num_tokens for s in samples))


@dataclass
class StepData:
    step: int
    micro_batches: list[MicroBatch]


class Loader:
    """This process's micro-batches of steps ``start..stop``, read from the memory-mapped shards.
    With ``background`` a thread reads a few steps ahead: for GPUs, whose host cores are idle
    meanwhile. Without, each step is read when it is due: on the CPU the cores a reader thread
    would use are the ones computing (reading is ~1% of a step there; a thread preempting the
    compute threads costs more)."""

    def __init__(
        self, index, plan, start, stop, rank, accum, dtype, pin: bool, background: bool, ahead=2
    ):
        self.index, self.plan, self.rank, self.accum = index, plan, rank, accum
        self.dtype, self.pin, self.background = dtype, pin, background
        self.start, self.stop = start, stop
        self.queue: queue.Queue = queue.Queue(maxsize=ahead)
        self.thread = threading.Thread(target=self._run, daemon=True)  # started by iterating

    def load(self, step: int) -> StepData:
        batch = self.plan.global_batch(step)
        micro = []
        for ids in batch[self.rank * self.accum : (self.rank + 1) * self.accum]:
            mb = collate([self.index.sample(int(g)) for g in ids], self.dtype)
            micro.append(mb.pin_memory() if self.pin else mb)
        return StepData(step, micro)

    def _run(self):
        try:
            for step in range(self.start, self.stop):
                self.queue.put(self.load(step))
        except BaseException as exc:  # surfaces in the training thread
            self.queue.put(exc)

    def __iter__(self) -> Iterator[StepData]:
        if not self.background:
            yield from (self.load(step) for step in range(self.start, self.stop))
            return
        self.thread.start()
        for _ in range(self.start, self.stop):
            item = self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
