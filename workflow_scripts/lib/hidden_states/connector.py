"""A vLLM KV connector that writes extracted hidden states straight into shard files.

vLLM's ``extract_hidden_states`` speculative method caches, per token, the residual stream at the
requested layers in a cache-only attention layer. Its stock ``ExampleHiddenStatesConnector`` then
saves one safetensors file per request, with a write path built on CUDA streams and pinned memory
(which fails on CPU: ``pin_memory=True requires a CUDA or other accelerator backend``).

``ShardHiddenStatesConnector`` keeps the stock scheduler side and lock protocol, and changes only
where the bytes go: each request carries a *target* in ``kv_transfer_params`` (a shard file the
driver created, its storage dtype, and the byte offsets of this sample's rows in each stored
tensor: the hidden states, and their scales for float8). The worker writes the rows there with ``pwrite``. No per-request
file is ever written; the per-request ``.lock`` file only signals completion, and the worker
writes ``ok <num_tokens>`` into it before releasing it (anything else means failure).

The rows are encoded as the shard stores them (``shard_writer.encode_sample``: the final rows the
loss reads, in the storage dtype) where they are gathered:

* CPU: copied out of the cache, encoded and written synchronously in the worker.
* GPU: encoded on the device, then a device-to-host copy on a side stream into pinned memory
  (of the encoded bytes: float8 storage copies a quarter of float32's), then a thread pool
  writes, as in the stock connector.

Load it with ``kv_transfer_config = {"kv_connector": "ShardHiddenStatesConnector",
"kv_connector_module_path": "workflow_scripts.lib.hidden_states.connector", "kv_role":
"kv_producer", "kv_connector_extra_config": {"shared_storage_path": <scratch dir for locks>}}``.

The layer ids passed to vLLM must be ascending with the final layer (id N) last: vLLM collects the
states in layer order, so the last row per token is the final state and the others are auxiliary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)
from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from workflow_scripts.lib.hidden_states.shard_writer import (
    encode_sample,
    write_encoded,
    write_sample_rows,
)

logger = init_logger(__name__)

TARGET_KEY = "shard_target"  # key in a request's kv_transfer_params
# A file to which every written sample appends "<pid> <request id> <tokens>" (tests, debugging):
# with tensor parallelism, one worker (rank 0) writes every sample, once.
WRITE_LOG_ENV = "EAGLE3_SHARD_WRITE_LOG"


def _log_write(req_id: str, num_tokens: int) -> None:
    path = os.environ.get(WRITE_LOG_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()} {req_id} {num_tokens}\n")


@dataclass
class ShardTargetMetadata(ExampleHiddenStatesConnectorMetadata):
    # req_id -> target, for requests scheduled for the first time this step.
    new_req_targets: dict[str, dict[str, Any]] = field(default_factory=dict)


class _Done:
    """Stands in for a CUDA event on the synchronous path: already complete."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather_states(
    kv_cache: torch.Tensor, block_ids: list[int], block_size: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's states from the cache-only layer's cache, laid out [blocks, layers,
    block_size, hidden] (what the stock connector indexes): ``aux`` [T, layers - 1, H] and
    ``final`` [T, H] (the last layer id is the final state), contiguous.

    Whole blocks are copied rather than gathered token by token. On a CPU the copies are done
    by numpy in this thread: torch's parallel index_select stalls for milliseconds per call
    when the other cores are busy (measured: 21 ms against 0.02 ms for 800 kB)."""
    needed = -(-num_tokens // block_size)
    ids = block_ids[:needed]
    if kv_cache.device.type == "cpu":
        raw = kv_cache.view(_SAME_SIZE_INT[kv_cache.element_size()]).numpy()
        blocks = raw.take(np.asarray(ids, dtype=np.int64), axis=0)  # [nb, L, bs, H]
        nb, layers, bs, hidden = blocks.shape
        aux = np.ascontiguousarray(blocks[:, :-1].transpose(0, 2, 1, 3))
        aux = aux.reshape(nb * bs, layers - 1, hidden)[:num_tokens]
        final = np.ascontiguousarray(blocks[:, -1]).reshape(nb * bs, hidden)[:num_tokens]
        return (
            torch.from_numpy(aux).view(kv_cache.dtype),
            torch.from_numpy(final).view(kv_cache.dtype),
        )
    index = torch.tensor(ids, dtype=torch.long).to(kv_cache.device, non_blocking=True)
    blocks = kv_cache.index_select(0, index)
    nb, layers, bs, hidden = blocks.shape
    aux = blocks[:, :-1].transpose(1, 2).reshape(nb * bs, layers - 1, hidden)[:num_tokens]
    final = blocks[:, -1].reshape(nb * bs, hidden)[:num_tokens]
    return aux.contiguous(), final.contiguous()


def _finish(lock_fd: int | None, status: str) -> None:
    """Record the outcome in the lock file, then release the lock (closing the fd)."""
    if lock_fd is None:
        return
    try:
        os.pwrite(lock_fd, status.encode() + b"\n", 0)
    finally:
        os.close(lock_fd)


class ShardHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Hidden states into shard files at given offsets; works on CPU and GPU."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._targets: dict[str, dict[str, Any]] = {}  # worker side: req_id -> target

    # ------------------------------------------------------------------ scheduler side

    def build_connector_meta(self, scheduler_output):
        base = super().build_connector_meta(scheduler_output)
        meta = ShardTargetMetadata(
            pending_saves=base.pending_saves, new_req_filenames=base.new_req_filenames
        )
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = (new_req.sampling_params.extra_args or {}) if new_req.sampling_params else {}
            target = (extra.get("kv_transfer_params") or {}).get(TARGET_KEY)
            if target is not None:
                meta.new_req_targets[new_req.req_id] = target
        return meta

    # ------------------------------------------------------------------ worker side

    def wait_for_save(self) -> None:
        super().wait_for_save()  # pre-creates the lock files (LOCK_EX held)
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, ShardTargetMetadata):
            self._targets.update(meta.new_req_targets)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        target = self._targets.pop(pending.req_id, None)
        if target is None:  # a request without a shard target: the stock per-request file
            super()._submit_async_write(pending)
            return
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        num_tokens = int(pending.token_ids.shape[0])
        if target.get("skip"):  # a request whose states are not wanted (the teacher check's)
            _finish(lock_fd, f"ok {num_tokens}")
            self._req_copy_events[pending.req_id] = _Done()
            return

        if self._kv_cache.device.type == "cpu":
            try:
                aux, final = gather_states(
                    self._kv_cache, pending.block_ids, self._block_size, num_tokens
                )
                write_sample_rows(target["path"], aux, final, target)
                _log_write(pending.req_id, num_tokens)
                status = f"ok {num_tokens}"
            except Exception as exc:  # reported to the driver through the lock file
                logger.error("hidden-state write failed for %s: %r", pending.req_id, exc)
                status = f"error {exc!r}"
            _finish(lock_fd, status)
            self._req_copy_events[pending.req_id] = _Done()
            return

        # GPU: encode on the device and copy on a side stream into pinned memory (so that a
        # smaller storage dtype shrinks the copy too); a thread waits for it and writes.
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream), gpu_sync_allowed():
            aux_dev, final_dev = gather_states(
                self._kv_cache, pending.block_ids, self._block_size, num_tokens
            )
            encoded = {}
            for name, tensor in encode_sample(aux_dev, final_dev, target).items():
                encoded[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                encoded[name].copy_(tensor, non_blocking=True)
        copy_done = torch.cuda.Event()
        copy_done.record(copy_stream)
        future = self._executor.submit(
            self._write_job, encoded, num_tokens, copy_done, target, lock_fd, pending.req_id
        )
        self._req_copy_events[pending.req_id] = copy_done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    @staticmethod
    def _write_job(
        encoded, num_tokens: int, event, target: dict[str, Any], lock_fd: int | None, req_id
    ) -> None:
        status = "error: not written"
        try:
            event.synchronize()
            write_encoded(target["path"], encoded, target)
            _log_write(req_id, num_tokens)
            status = f"ok {num_tokens}"
        except Exception as exc:
            status = f"error {exc!r}"
            raise
        finally:
            _finish(lock_fd, status)
