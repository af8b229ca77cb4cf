"""train: extraction manifest + vocab map + verifier head -> EAGLE-3 draft checkpoint.

    python -m workflow_scripts.train --manifest ... --vocab-map ... --verifier ... \\
        --state-dir ... --draft ... --metrics ... <every train.* parameter>

1. Checks every input before anything expensive: the manifest against the verifier's config
   (hidden size, layer count and ids, vocabulary, the verifier's identity), the vocab map against
   the verifier's vocabulary, every shard's presence and checksum, the verifier tensors the draft
   needs, the GPUs it was given. Each problem stops the run with a message naming it.
2. Reads only the embedding, the final norm and the draft vocabulary's lm_head rows from the
   verifier's safetensors (sharded checkpoints through their index); never the whole verifier.
3. Streams samples from the memory-mapped shards in a deterministic order (seeded per epoch),
   packed into padded micro-batches of at most ``micro_batch_budget_tokens``; a seeded held-out
   split is scored at every checkpoint and at the end.
4. Trains with AdamW, linear warm-up then cosine decay, gradient clipping; bf16 autocast on GPUs,
   float32 on the CPU. With ``num_gpus`` > 1 (or ``num_cpu_processes`` > 1 on the CPU) it starts
   itself under torchrun and trains with DDP (nccl / gloo). A global batch is ``processes x
   grad_accum_steps`` micro-batches and the loss is normalised by its global counts, so one
   process with 2 accumulation steps and two processes with 1 train the same model.
5. Every ``checkpoint_every_steps`` it writes ``<state_dir>/state.pt`` atomically (weights,
   optimizer, scheduler, RNG, step). A killed run resumes there and repeats the uninterrupted run's
   steps exactly. A state from other settings or inputs is discarded, never resumed.
6. Logs loss, per-TTT-step top-1 agreement with the verifier, tokens/s and ETA; one JSONL row per
   step (and per validation) goes to the metrics file. At the end it writes the draft checkpoint
   (speculators format, see ``checkpoint.py``) and the metrics, atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from workflow_scripts import cli, shards
from workflow_scripts.checkpoint import speculators_config, write_draft_checkpoint
from workflow_scripts.common import (
    UserError,
    atomic_path,
    format_seconds,
    run_main,
    sha256_file,
    verifier_config,
)
from workflow_scripts.draft_model import (
    STAT_KEYS,
    DraftConfig,
    Eagle3Draft,
    TeacherHead,
    llama_layer_config,
    param_count,
)
from workflow_scripts.stages import TrainIO, TrainParams

log = logging.getLogger("eagle3")

STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"
VERIFIED_FILE = "verified_shards.json"
PACK_WINDOW_SAMPLES = 256  # samples sorted by length together when packing micro-batches
# Parameters that do not change what is trained: a state saved under other values is resumed.
NOT_IN_FINGERPRINT = ("checkpoint_every_steps", "log_every_steps", "num_speculative_tokens")


# --------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    """Everything checked before the first step."""

    verifier_cfg: dict[str, Any]
    manifest: dict[str, Any]
    aux_layer_ids: list[int]  # ascending: the order vLLM concatenates them in
    aux_order: list[int] | None  # permutation of the shards' aux axis into that order, if needed
    d2t: torch.Tensor
    t2d: torch.Tensor
    tensors: dict[str, tuple[Path, str]]  # embed / norm / lm_head -> (file, tensor name)
    index: "SampleIndex"
    fingerprint: str


def check_manifest(manifest: dict, vcfg: dict, verifier_dir: Path, where: Path) -> None:
    H, N, V = int(vcfg["hidden_size"]), int(vcfg["num_hidden_layers"]), int(vcfg["vocab_size"])
    hint = "re-run extraction for this verifier"
    if manifest.get("layer_convention") != shards.LAYER_CONVENTION:
        raise UserError(
            f"{where}: layer_convention {manifest.get('layer_convention')!r} is not the one this "
            f"workflow uses ({shards.LAYER_CONVENTION!r}); {hint}"
        )
    if manifest.get("hidden_size") != H:
        raise UserError(
            f"{where}: hidden_size {manifest.get('hidden_size')} does not match the verifier "
            f"{verifier_dir} (hidden_size {H}); {hint}"
        )
    if manifest.get("num_hidden_layers") != N:
        raise UserError(
            f"{where}: num_hidden_layers {manifest.get('num_hidden_layers')} does not match the "
            f"verifier {verifier_dir} ({N} layers); {hint}"
        )
    aux = list(manifest.get("aux_layer_ids") or [])
    bad = [i for i in aux if not isinstance(i, int) or not 0 <= i < N]
    if not aux or bad:
        raise UserError(
            f"{where}: aux_layer_ids {aux} do not fit the verifier {verifier_dir} with {N} layers: "
            f"ids must be in 0..{N - 1} (vLLM's convention: id k is the input of decoder layer "
            f"k; {N} is the final state, never an auxiliary one); {hint}"
        )
    if len(set(aux)) != len(aux):
        raise UserError(f"{where}: aux_layer_ids {aux} repeat a layer; {hint}")
    if manifest.get("final_layer_id") != N:
        raise UserError(
            f"{where}: final_layer_id {manifest.get('final_layer_id')} is not the verifier's "
            f"last layer output ({N}); {hint}"
        )
    if manifest.get("vocab_size") != V:
        raise UserError(
            f"{where}: vocab_size {manifest.get('vocab_size')} does not match the verifier "
            f"{verifier_dir} (vocab_size {V}); {hint}"
        )
    recorded = (manifest.get("verifier") or {}).get("config_sha256")
    actual = sha256_file(Path(verifier_dir) / "config.json")
    if recorded != actual:
        raise UserError(
            f"{where}: extracted from another verifier (config.json sha256 {str(recorded)[:12]}, "
            f"{verifier_dir}/config.json has {actual[:12]}); {hint}"
        )
    if manifest.get("dtype") not in ("float32", "bfloat16", "float16"):
        raise UserError(f"{where}: unknown dtype {manifest.get('dtype')!r}")
    if not manifest.get("shards") or not manifest.get("num_samples"):
        raise UserError(f"{where}: no samples; was the tokenized data empty?")


def check_vocab_map(path: Path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        tensors = load_file(str(path))
        d2t, t2d = tensors["d2t"], tensors["t2d"]
    except Exception as exc:  # a missing file, a truncated one, a missing tensor
        raise UserError(f"cannot read the vocab map {path}: {exc}") from None
    K = d2t.numel()
    if K > vocab_size:
        raise UserError(
            f"{path}: the draft vocabulary ({K} tokens) is larger than the verifier's vocabulary "
            f"({vocab_size} tokens); rebuild the vocab map for this verifier"
        )
    if t2d.numel() != vocab_size:
        raise UserError(
            f"{path}: built for a vocabulary of {t2d.numel()} tokens, but the verifier has "
            f"{vocab_size}; was it built with another tokenizer? Rebuild the vocab map"
        )
    targets = torch.arange(K, dtype=torch.int64) + d2t.to(torch.int64)
    if int(t2d.sum()) != K or not torch.equal(t2d.nonzero().flatten(), targets):
        raise UserError(f"{path}: d2t and t2d disagree about the draft vocabulary; rebuild it")
    return d2t.to(torch.int64), t2d.to(torch.bool)


def verify_shard_checksums(manifest: dict, state_dir: Path) -> None:
    """sha256 of every shard against the manifest, in parallel threads. Results are remembered
    in the state dir by (size, mtime), so a resumed run does not hash terabytes again."""
    cache_path = state_dir / VERIFIED_FILE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, json.JSONDecodeError):
        cache = {}

    def key(entry):
        st = os.stat(entry["path"])
        return [st.st_size, st.st_mtime_ns, entry["sha256"]]

    todo = [e for e in manifest["shards"] if cache.get(e["path"]) != key(e)]
    if not todo:
        return
    started = time.monotonic()
    log.info("verifying the checksums of %d shard(s)", len(todo))
    workers = min(8, len(todo), os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda e: sha256_file(e["path"]), todo))
    for entry, digest in zip(todo, digests):
        if digest != entry["sha256"]:
            raise UserError(
                f"shard {entry['path']} does not match its checksum in the manifest (corrupt or "
                "overwritten); delete it and re-run extraction"
            )
        cache[entry["path"]] = key(entry)
    log.info("checksums verified in %s", format_seconds(time.monotonic() - started))
    state_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(cache_path) as tmp:
        tmp.write_text(json.dumps(cache))


def run_fingerprint(io: TrainIO, p: TrainParams) -> str:
    """What a resumable state must have been trained from: settings and input contents."""
    settings = p.model_dump(mode="json", exclude=set(NOT_IN_FINGERPRINT))
    files = {
        "manifest": sha256_file(io.manifest),
        "vocab_map": sha256_file(io.vocab_map),
        "verifier_config": sha256_file(Path(io.verifier) / "config.json"),
    }
    blob = json.dumps({"settings": settings, "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_inputs(io: TrainIO, p: TrainParams, verify_checksums: bool = True) -> Inputs:
    vcfg = verifier_config(io.verifier)
    V = int(vcfg["vocab_size"])
    manifest = shards.load_manifest(io.manifest)  # every shard present
    check_manifest(manifest, vcfg, Path(io.verifier), Path(io.manifest))
    d2t, t2d = check_vocab_map(Path(io.vocab_map), V)
    if verify_checksums:
        verify_shard_checksums(manifest, Path(io.state_dir))
    tensors = locate_verifier_tensors(Path(io.verifier), vcfg)
    aux = list(manifest["aux_layer_ids"])
    ascending = sorted(aux)
    aux_order = None if aux == ascending else [aux.index(i) for i in ascending]
    index = SampleIndex(manifest, aux_order, p.micro_batch_budget_tokens)
    if p.num_gpus > 0 and torch.cuda.device_count() < p.num_gpus:
        raise UserError(
            f"train.num_gpus is {p.num_gpus} but {torch.cuda.device_count()} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    if p.ttt_steps < p.num_speculative_tokens:
        log.warning(
            "train.ttt_steps (%d) is below num_speculative_tokens (%d): the later draft tokens "
            "are served untrained",
            p.ttt_steps,
            p.num_speculative_tokens,
        )
    return Inputs(
        verifier_cfg=vcfg,
        manifest=manifest,
        aux_layer_ids=ascending,
        aux_order=aux_order,
        d2t=d2t,
        t2d=t2d,
        tensors=tensors,
        index=index,
        fingerprint=run_fingerprint(io, p),
    )


# --------------------------------------------------------------------------- verifier tensors


def _weight_map(verifier_dir: Path) -> dict[str, Path]:
    index = verifier_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise UserError(f"cannot read {index}: {exc}") from None
        return {name: verifier_dir / file for name, file in weight_map.items()}
    files = sorted(verifier_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{verifier_dir}: no safetensors weights (model.safetensors or an index)")
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            names.update({name: file for name in fh.keys()})
    return names


def _pick(names: list[str], suffix: str, prefix: str | None = None) -> str | None:
    if prefix is not None and prefix + suffix in names:
        return prefix + suffix
    pattern = re.compile(r"(^|\.)" + re.escape(suffix) + "$")
    found = [
        n
        for n in names
        if pattern.search(n) and not re.search(r"(^|\.)(layers|mtp|vision|visual)\.", n)
    ]
    return min(found, key=len) if found else None


def locate_verifier_tensors(verifier_dir: Path, vcfg: dict) -> dict[str, tuple[Path, str]]:
    """Where the embedding, the final norm and the lm_head are (lm_head: the embedding when the
    weights are tied), with their shapes checked."""
    weight_map = _weight_map(verifier_dir)
    names = list(weight_map)
    embed = _pick(names, "embed_tokens.weight")
    if embed is None:
        raise UserError(f"{verifier_dir}: no embed_tokens.weight among the verifier's tensors")
    prefix = embed[: -len("embed_tokens.weight")]
    norm = _pick(names, "norm.weight", prefix)
    if norm is None:
        raise UserError(f"{verifier_dir}: no final norm.weight among the verifier's tensors")
    lm_head = _pick(names, "lm_head.weight")
    if lm_head is None:
        if vcfg.get("tie_word_embeddings") is False:
            raise UserError(f"{verifier_dir}: no lm_head.weight, and the embeddings are not tied")
        lm_head = embed
    located = {
        k: (weight_map[n], n) for k, n in (("embed", embed), ("norm", norm), ("lm_head", lm_head))
    }
    H, V = int(vcfg["hidden_size"]), int(vcfg["vocab_size"])
    expected = {"embed": [V, H], "norm": [H], "lm_head": [V, H]}
    for key, (file, name) in located.items():
        if not file.is_file():
            raise UserError(f"{verifier_dir}: {name} should be in {file.name}, which is missing")
        with safe_open(str(file), framework="pt") as fh:
            shape = list(fh.get_slice(name).get_shape())
        if shape != expected[key]:
            raise UserError(
                f"{file}: {name} has shape {shape}, expected {expected[key]} from config.json"
            )
    return located


def read_verifier_tensor(
    where: tuple[Path, str], rows: torch.Tensor | None = None, chunk_rows: int = 8192
) -> torch.Tensor:
    """One tensor from a safetensors file; with ``rows`` (bool mask) only those rows, read in
    chunks so a large lm_head never sits in memory whole."""
    file, name = where
    with safe_open(str(file), framework="pt") as fh:
        tensor = fh.get_slice(name)
        if rows is None:
            return tensor[:]
        parts = []
        for start in range(0, rows.numel(), chunk_rows):
            select = rows[start : start + chunk_rows]
            if select.any():
                parts.append(tensor[start : start + select.numel()][select])
        return torch.cat(parts)


# --------------------------------------------------------------------------- data


class SampleIndex:
    """Every sample's shard, place and length; samples are read from the memory-mapped shards
    only when a micro-batch needs them."""

    def __init__(self, manifest: dict, aux_order: list[int] | None, max_tokens: int):
        self.aux_order = aux_order
        self.max_tokens = max_tokens
        self.readers, shard_of, local_of, lengths = [], [], [], []
        n_aux, H = len(manifest["aux_layer_ids"]), manifest["hidden_size"]
        for i, entry in enumerate(manifest["shards"]):
            try:
                reader = shards.ShardReader(Path(entry["path"]))
                first = reader.sample(0)
            except Exception as exc:
                raise UserError(f"shard {entry['path']} is unreadable: {exc}") from None
            n = first.num_tokens
            aux_shape = list(first.aux_hidden_states.shape)
            final_shape = list(first.final_hidden_states.shape)
            if (
                len(reader) != entry["num_samples"]
                or aux_shape != [n, n_aux, H]
                or final_shape != [n, H]
            ):
                raise UserError(
                    f"shard {entry['path']} does not hold what the manifest says ({len(reader)} "
                    f"samples, first sample: aux {aux_shape}, final {final_shape}; manifest: "
                    f"{entry['num_samples']} samples, {n_aux} aux layers, hidden size {H})"
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
        s = self.readers[self.shard_of[g]].sample(int(self.local_of[g]))
        n = int(self.lengths[g])
        aux = s.aux_hidden_states[:n]
        if self.aux_order is not None:
            aux = aux[:, self.aux_order]
        return shards.SampleStates(aux, s.final_hidden_states[:n], s.input_ids[:n], s.loss_mask[:n])


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
    consecutive micro-batches; an epoch's leftover micro-batches are dropped."""

    def __init__(
        self, train_ids, lengths, budget: int, seed: int, epochs: int, micro_per_step: int
    ):
        self.train_ids, self.lengths, self.budget, self.seed = train_ids, lengths, budget, seed
        self.micro_per_step = micro_per_step
        self.steps_per_epoch = [len(self._micro(e)) // micro_per_step for e in range(epochs)]
        self.total_steps = sum(self.steps_per_epoch)
        self._cached: tuple[int, list[np.ndarray]] | None = None

    def _micro(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, 2, epoch])
        return pack_micro_batches(self.train_ids, self.lengths, self.budget, rng)

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


# --------------------------------------------------------------------------- processes


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()


def setup_processes(p: TrainParams) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    wanted = p.num_gpus if p.num_gpus > 0 else p.num_cpu_processes
    if world != wanted:
        raise UserError(f"started as {world} process(es), the settings ask for {wanted}")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if p.num_gpus > 0:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # else torch already follows it
            torch.set_num_threads(threads_per_process(world))
    if world > 1:
        dist.init_process_group("nccl" if p.num_gpus > 0 else "gloo")
    return Dist(rank, world, local_rank, device)


def threads_per_process(world: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // world)


def launch_processes(argv: list[str], world: int, on_gpu: bool) -> None:
    """Run this script under torchrun with ``world`` processes on this node, and wait."""
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (package_root, env.get("PYTHONPATH")) if x)
    if not on_gpu:  # the CPU cores shared out (torchrun would give each process one)
        env.setdefault("OMP_NUM_THREADS", str(threads_per_process(world)))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", "-m", "workflow_scripts.train", *argv,
    ]  # fmt: skip
    log.info("starting %d training processes: %s", world, shlex.join(cmd))
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise SystemExit(rc)


# --------------------------------------------------------------------------- training


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def summarize(stats: torch.Tensor, decay: float) -> dict[str, Any]:
    """stats [3, S] (kl, correct, count summed over a batch) -> loss and per-step figures."""
    kl, correct, count = stats
    count = count.clamp(min=1)
    per_step_kl = (kl / count).tolist()
    return {
        "loss": sum(decay**k * v for k, v in enumerate(per_step_kl)),
        "kl_per_step": [round(v, 6) for v in per_step_kl],
        "top1_agreement": [round(v, 6) for v in (correct / count).tolist()],
        "positions_per_step": [int(v) for v in stats[2].tolist()],
    }


def fmt_list(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def build_draft(
    inputs: Inputs, seed: int, embed_dtype: torch.dtype | None = torch.float32
) -> tuple[Eagle3Draft, TeacherHead]:
    """The draft as training starts it, and the teacher. Both take the verifier's final norm and
    the draft vocabulary's lm_head rows: the teacher frozen, the draft as its starting point.
    The embedding is the verifier's, frozen (``embed_dtype`` None keeps the verifier's dtype)."""
    layer_config = llama_layer_config(inputs.verifier_cfg)
    layer_config["num_aux_hidden_states"] = len(inputs.aux_layer_ids)
    cfg = DraftConfig.from_layer_config(layer_config, inputs.d2t.numel(), len(inputs.aux_layer_ids))
    embed = read_verifier_tensor(inputs.tensors["embed"])
    norm = read_verifier_tensor(inputs.tensors["norm"]).float()
    head_rows = read_verifier_tensor(inputs.tensors["lm_head"], rows=inputs.t2d).float()
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.embed_tokens.to(embed_dtype or embed.dtype)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head_rows)
        model.norm.weight.copy_(norm)
    return model, TeacherHead(norm, head_rows, cfg.rms_norm_eps)


def write_draft(directory: Path, model: Eagle3Draft, inputs: Inputs, io: TrainIO, p: TrainParams):
    """The draft checkpoint vLLM serves (speculators format, see checkpoint.py)."""
    vcfg = inputs.verifier_cfg
    dtype = vcfg.get("torch_dtype") or vcfg.get("dtype")
    config = speculators_config(
        layer_config=model.cfg.layer_config,
        draft_vocab_size=inputs.d2t.numel(),
        aux_layer_ids=inputs.aux_layer_ids,
        num_speculative_tokens=p.num_speculative_tokens,
        verifier_name_or_path=str(Path(io.verifier).resolve()),
        verifier_architectures=vcfg.get("architectures"),
        norm_before_residual=model.cfg.norm_before_residual,
        dtype=dtype if dtype in ("bfloat16", "float16") else "float32",
    )
    write_draft_checkpoint(directory, model.trainable_state_dict(), config, inputs.d2t, inputs.t2d)


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
        self.data_dtype = shards.TORCH_DTYPES[inputs.manifest["dtype"]] if on_gpu else torch.float32

        model, teacher = build_draft(inputs, p.seed, embed_dtype=None if on_gpu else torch.float32)
        self.model, self.teacher = model.to(d.device), teacher.to(d.device)
        cfg = self.model.cfg
        if d.world > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[d.local_rank] if on_gpu else None,
                broadcast_buffers=False,
            )
        else:
            self.ddp = self.model
        params = [q for q in self.model.parameters() if q.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=p.learning_rate, weight_decay=p.weight_decay)

        # the data
        train_ids, self.val_ids = split_samples(len(inputs.index), p.validation_fraction, p.seed)
        self.plan = Plan(
            train_ids,
            inputs.index.lengths,
            p.micro_batch_budget_tokens,
            p.seed,
            p.epochs,
            d.world * p.grad_accum_steps,
        )
        if self.plan.total_steps == 0:
            raise UserError(
                f"the training split ({len(train_ids)} samples) does not fill one global batch of "
                f"{d.world * p.grad_accum_steps} micro-batches (processes x grad_accum_steps); "
                "lower train.micro_batch_budget_tokens or grad_accum_steps, or add data"
            )
        total = self.plan.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, p.warmup_steps, total, p.min_lr_ratio)
        )
        self.step = 0
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
        if self.d.world > 1:
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
            }
            with atomic_path(self.state_dir / STATE_FILE) as tmp:
                torch.save(state, tmp)
            log.info("checkpoint: step %d saved to %s", self.step, self.state_dir / STATE_FILE)
        self.d.barrier()

    def restore_state(self) -> None:
        path = self.state_dir / STATE_FILE
        if not path.exists():
            if self.d.main:
                self._rewrite_metrics(keep_until=-1)
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
                self._rewrite_metrics(keep_until=-1)
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
        if self.d.main:
            self._rewrite_metrics(keep_until=self.step)
            log.info("resumed from %s at step %d of %d", path, self.step, self.plan.total_steps)
        self.d.barrier()

    def _rewrite_metrics(self, keep_until: int) -> None:
        """Drop metrics rows past the resumed step (a killed run may have logged beyond it)."""
        path = self.state_dir / METRICS_FILE
        rows = []
        if path.exists() and keep_until >= 0:
            rows = [line for line in path.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if json.loads(r)["step"] <= keep_until]
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text("".join(r + "\n" for r in rows))

    def write_metrics(self, row: dict) -> None:
        if self.d.main:
            with open(self.state_dir / METRICS_FILE, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    # ---- steps

    def train_step(self, data: StepData) -> tuple[torch.Tensor, float]:
        """One optimizer step over this process's micro-batches; returns summed stats and the
        gradient norm."""
        p, S = self.p, self.p.ttt_steps
        # the loss is a mean over the whole global batch: its counts, summed over processes
        local = [sum(c) for c in zip(*(mb.counted_positions(S) for mb in data.micro_batches))]
        denominators = self.d.all_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        stats = torch.zeros(len(STAT_KEYS), S, dtype=torch.float64)
        for i, mb in enumerate(data.micro_batches):
            mb = mb.to(self.d.device, non_blocking=True)
            last = i == len(data.micro_batches) - 1
            sync = contextlib.nullcontext() if last or self.d.world == 1 else self.ddp.no_sync()
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
                _, s = self.model(
                    mb.aux_hidden, mb.final_hidden, mb.input_ids, mb.loss_mask, self.teacher, S
                )
            stats += torch.stack([s[k] for k in STAT_KEYS])
        summary = summarize(self.d.all_sum(stats), self.p.ttt_step_loss_decay)
        row = {"step": self.step, "split": "val", **summary}
        self.write_metrics(row)
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
        p, d = self.p, self.d
        self.restore_state()
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
        validated_at = self.step if self.step > 0 else None  # a state is saved after validating
        for data in loader:
            stats, grad_norm = self.train_step(data)
            self.step += 1
            tokens = sum(mb.num_tokens for mb in data.micro_batches)
            totals = d.all_sum(
                torch.cat([stats.flatten(), torch.tensor([float(tokens)], dtype=torch.float64)])
            )
            stats, tokens = totals[:-1].view(len(STAT_KEYS), p.ttt_steps), int(totals[-1])
            summary = summarize(stats, p.ttt_step_loss_decay)
            now = time.monotonic()
            window_tokens += tokens
            done = self.step - first_step
            eta = (now - started) / done * (total - self.step)
            row = {
                "step": self.step,
                "split": "train",
                "epoch": self.plan.locate(self.step - 1)[0],
                **summary,
                "lr": self.lr,
                "grad_norm": grad_norm,
                "tokens": tokens,
                "tokens_per_s": round(tokens / max(now - last, 1e-9), 1),
                "elapsed_s": round(now - started, 3),
                "eta_s": round(eta, 1),
            }
            last = now
            self.write_metrics(row)
            if d.main and (done == 1 or self.step % p.log_every_steps == 0 or self.step == total):
                log.info(
                    "step %d/%d epoch %d: loss %.4f, top-1 agreement per TTT step %s, lr %.2e, "
                    "%.0f tokens/s, ETA %s",
                    self.step,
                    total,
                    row["epoch"] + 1,
                    summary["loss"],
                    fmt_list(summary["top1_agreement"]),
                    row["lr"],
                    window_tokens / max(now - window_start, 1e-9),
                    format_seconds(eta),
                )
                window_start, window_tokens = now, 0
            if self.step % p.checkpoint_every_steps == 0 and self.step < total:
                self.validate()
                validated_at = self.step
                self.save_state()
        if validated_at != self.step:
            self.validate()
        self.save_state()
        if d.main:
            self.write_outputs()
        d.barrier()

    def write_outputs(self) -> None:
        write_draft(self.io.draft, self.model, self.inputs, self.io, self.p)
        with atomic_path(self.io.metrics) as tmp:
            tmp.write_bytes((self.state_dir / METRICS_FILE).read_bytes())
        log.info("draft checkpoint written to %s, metrics to %s", self.io.draft, self.io.metrics)


# --------------------------------------------------------------------------- entry


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    io, p = cli.parse("train", argv)
    wanted = p.num_gpus if p.num_gpus > 0 else p.num_cpu_processes
    if wanted > 1 and "LOCAL_RANK" not in os.environ:
        check_inputs(io, p)  # every input problem is reported here, before any process starts
        launch_processes(argv, wanted, on_gpu=p.num_gpus > 0)
        return
    d = setup_processes(p)
    try:
        inputs = check_inputs(io, p)
        Trainer(io, p, inputs, d).run()
    finally:
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
