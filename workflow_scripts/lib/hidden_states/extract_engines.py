"""The engines that run the verifier for extraction, both writing through
``shard_writer.ShardWriter``, and the run of the extraction stage over the shards its plan
(``shard_plan.py``, made by ``extraction.py``) left to compute.

* vLLM: the ``extract_hidden_states`` speculative method with ``ShardHiddenStatesConnector``
  (``connector.py``), which writes each finished request's rows straight into its
  place in the shard file. The driver keeps the engine fed with up to twice its step budget
  (``batch_size_samples`` samples, ``batch_budget_tokens`` tokens) of queued requests, in shard
  order, and finishes a shard as soon as its last sample is written. It holds no hidden states.
* transformers: the reference. One sample at a time; aux id k is ``hidden_states[k]`` (the input
  of decoder layer k) and the final state is the input of the final norm (a pre-hook on it).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from workflow_scripts.lib.common import Progress
from workflow_scripts.lib.hidden_states import teacher_record
from workflow_scripts.lib.hidden_states.shard_plan import Plan, ShardPlan, read_rows, sample_tensors
from workflow_scripts.lib.hidden_states.shard_writer import ShardJob, remember_entry
from workflow_scripts.lib.hidden_states.shards import TORCH_DTYPES
from workflow_scripts.lib.hidden_states.transformers_backend import TransformersExtractor
from workflow_scripts.lib.verifier import engine
from workflow_scripts.lib.verifier.engine import engine_args, engine_in_process

log = logging.getLogger("eagle3")
CONNECTOR = "ShardHiddenStatesConnector"  # the class in connector.py


class Finisher:
    """Finishes shards (fsync, rename, checksum by reading back) in a background thread, so
    the engine is not kept waiting; ``wait`` returns the results in submission order and
    raises the first error."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-finish")
        self._futures: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._futures.append(self._pool.submit(fn, *args))

    def wait(self) -> list[Any]:
        try:
            return [f.result() for f in self._futures]
        finally:
            self._futures.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# --------------------------------------------------------------------------- vLLM


def vllm_engine_args(
    verifier: Path,
    p,
    dtype: str,
    layer_ids: list[int] | None,
    scratch: Path | None,
) -> dict[str, Any]:
    """vllm.LLM arguments from the extract settings. ``layer_ids`` None: a plain engine with
    the same settings and no extraction (the benchmark's baseline)."""
    kwargs = engine_args(
        p,
        verifier,
        dtype,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # every sample computed in full, never from another's cache
        max_num_seqs=p.batch_size_samples,
        max_num_batched_tokens=p.batch_budget_tokens,
        disable_log_stats=True,
    )
    if layer_ids is not None:
        assert scratch is not None
        from workflow_scripts.lib.hidden_states import connector

        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        }
        kwargs["kv_transfer_config"] = {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": connector.__name__,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(scratch)},
        }
    return kwargs


MAX_IDLE_STEPS = 100_000


def _wait_written(hidden_states_path: str, block: bool) -> str | None:
    """The status the connector left in the request's lock file, or None while it is still
    writing (only when not ``block``). Removes the lock file once read."""
    lock_path = hidden_states_path + ".lock"
    with open(lock_path) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        status = fh.read().strip()
    os.remove(lock_path)
    return status


def run_vllm(
    llm,
    jobs: Iterable[ShardJob],
    *,
    batch_size_samples: int,
    batch_budget_tokens: int,
    extract: bool,
    num_aux: int = 0,
    hidden_size: int = 0,
    storage: torch.dtype = torch.float32,
    on_sample: Callable[[int], None] = lambda tokens: None,
    on_shard: Callable[[ShardJob], None] = lambda job: None,
    ready: Callable[[ShardJob], bool] | None = None,
) -> None:
    """Run every sample of ``jobs`` through the engine, in order, keeping up to twice the
    engine's step budget queued. With ``extract``, each request carries its place in its shard
    and a shard is finished (``on_shard``) once all its samples are written; without, this is
    plain prefill (max_tokens=1) of the same samples. ``ready``: a shard's first sample is
    queued only once it says so; meanwhile the engine goes on with what it has (a disk budget:
    the shards before it finish, and are read and removed by training)."""
    from vllm import SamplingParams

    from workflow_scripts.lib.hidden_states.connector import TARGET_KEY

    engine = llm.llm_engine
    in_process = engine_in_process(llm)
    idle_steps = 0
    max_samples = 2 * batch_size_samples
    max_tokens = 2 * batch_budget_tokens
    queue: Iterator[tuple[ShardJob, int]] = (
        (job, i) for job in jobs for i in range(len(job.samples))
    )
    nxt = next(queue, None)
    in_flight: dict[str, tuple[ShardJob, int, int]] = {}
    in_flight_tokens = 0
    unwritten: deque[tuple[str, ShardJob, int, int]] = deque()  # finished, write pending
    remaining: dict[int, int] = {}

    def finish_sample(job: ShardJob, i: int, tokens: int) -> None:
        remaining[job.index] -= 1
        if i >= 0:
            on_sample(tokens)
            if extract:
                job.writer.done(i)
        if remaining[job.index] == 0:
            del remaining[job.index]
            on_shard(job)

    def add_check(job: ShardJob) -> None:
        """The teacher check's request for a shard (teacher_record.py): a prefix of one of its
        samples with the verifier's top-1 at every position; its states are not written."""
        check = job.extra["check"]
        ids = job.samples[check["sample"]][0][: check["tokens"]]
        req_id = f"check:{job.index}"
        engine.add_request(
            req_id,
            {"prompt_token_ids": ids.tolist()},
            SamplingParams(
                max_tokens=1,
                temperature=0.0,
                prompt_logprobs=1,
                detokenize=False,
                extra_args={"kv_transfer_params": {TARGET_KEY: {"skip": True}}},
            ),
        )
        in_flight[req_id] = (job, -1, int(ids.numel()))
        remaining[job.index] += 1

    def may_queue(job: ShardJob, i: int) -> bool:
        """A shard's first sample waits for ``ready``; so does a shard computed again while
        its previous copy is still in flight (the same index: ``ready`` holds it until training
        has read and removed that copy)."""
        if ready is None or i > 0:
            return True
        return ready(job)

    while nxt is not None or in_flight or unwritten:
        while (
            nxt is not None
            and (
                not in_flight
                or (
                    len(in_flight) < max_samples
                    and in_flight_tokens + nxt[0].samples[nxt[1]][0].numel() <= max_tokens
                )
            )
            and may_queue(*nxt)
        ):
            job, i = nxt
            ids = job.samples[i][0]
            if job.index not in remaining:
                remaining[job.index] = len(job.samples)
                if extract:
                    job.open(num_aux, hidden_size, storage)
                    if job.extra.get("check"):
                        add_check(job)
            extra = {"kv_transfer_params": {TARGET_KEY: job.writer.target(i)}} if extract else None
            req_id = f"{job.index}:{i}"
            engine.add_request(
                req_id,
                {"prompt_token_ids": ids.tolist()},
                SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra),
            )
            in_flight[req_id] = (job, i, int(ids.numel()))
            in_flight_tokens += int(ids.numel())
            nxt = next(queue, None)

        # samples whose rows the worker may still be writing: collect those already written
        while unwritten:
            path, job, i, tokens = unwritten[0]
            # an engine in another process writes on its own: wait when there is nothing else
            # to do; an engine in this process writes only when stepped
            status = _wait_written(path, block=not in_flight and not in_process)
            if status is None:
                break
            unwritten.popleft()
            idle_steps = 0
            if status != f"ok {tokens}":
                raise RuntimeError(
                    f"hidden states of sample {i} of shard {job.index} were not written: "
                    f"{status or 'the engine died while writing'}"
                )
            finish_sample(job, i, tokens)

        if not in_flight and not (unwritten and in_process):
            if nxt is not None and not unwritten:
                time.sleep(0.2)  # waiting for ``ready``
            continue
        outputs = engine.step()
        idle_steps = 0 if outputs else idle_steps + 1
        if idle_steps > MAX_IDLE_STEPS:
            raise RuntimeError(f"the engine made no progress in {MAX_IDLE_STEPS} steps")
        for out in outputs:
            if not out.finished:
                continue
            job, i, tokens = in_flight.pop(out.request_id)
            if i >= 0:
                in_flight_tokens -= tokens
            else:
                check = job.extra["check"]
                job.extra["teacher_check"] = {
                    **check,
                    "top1": teacher_record.top1_from_vllm(out, check),
                }
            if extract:
                params = out.kv_transfer_params or {}
                if "hidden_states_path" not in params:
                    raise RuntimeError(f"request {out.request_id}: no hidden states reported")
                unwritten.append((params["hidden_states_path"], job, i, tokens))
            else:
                finish_sample(job, i, tokens)


# --------------------------------------------------------------------------- the stage's run


def wait_ready(shards, ready, poll_s: float = 0.2):
    """``shards`` each yielded once ``ready`` says so (for an engine that takes one at a time)."""
    for shard in shards:
        while not ready(shard):
            time.sleep(poll_s)
        yield shard


def shard_jobs(io, plan: Plan, shards: list[ShardPlan]):
    """ShardJobs for the backends, reading each shard's samples only when it is reached."""
    vocab = int(plan.cfg["vocab_size"])
    for shard in shards:
        samples = [
            sample_tensors(io.tokenized, i, row, vocab)
            for i, row in read_rows(io.tokenized, plan.line_offsets, shard.samples)
        ]
        meta = plan.shard_metadata(shard)
        extra = {"plan": shard, "check": teacher_record.choose(samples)}
        yield ShardJob(shard.index, shard.path, samples, meta, extra=extra)


def extract(
    io,
    p,
    plan: Plan,
    shards: list[ShardPlan] | None = None,
    ready: Callable[[ShardPlan], bool] | None = None,
    label: str | None = None,
) -> None:
    """Compute ``shards`` (default: the plan's still to do), in order; ``ready``: each shard
    starts only once it says so (a disk budget, ``stream_producer.py``)."""
    shards = plan.todo if shards is None else shards
    todo = [s for s in shards if s.samples]
    for s in shards:
        if not s.samples:  # every sample of it skipped: nothing to compute, nothing to write
            s.entry = {"file": None}
    if not todo:
        return
    storage = TORCH_DTYPES[plan.storage]
    progress = Progress(
        label or f"extract job {io.job_index}",
        total=sum(len(s.samples) for s in todo),
        interval_s=p.progress_interval_s,
        unit="samples",
    )

    def finish(job: ShardJob) -> None:
        shard, writer = job.extra["plan"], job.writer
        check = job.extra.get("teacher_check")
        entry = writer.finish({"teacher_check": check} if check else None)
        planned = plan.shard_bytes(shard)
        if entry["bytes"] != planned:  # the disk plan is exact
            raise RuntimeError(
                f"{shard.path}: {entry['bytes']} bytes, the disk plan said {planned}"
            )
        try:
            shard.entry = remember_entry(shard.path, entry)
        except FileNotFoundError:  # a disk budget: training read it and removed it already
            shard.entry = entry
        log.info(
            "shard %d done: %d samples, %d tokens, %.1f MiB",
            shard.index,
            entry["num_samples"],
            entry["num_tokens"],
            entry["bytes"] / 2**20,
        )

    finisher = Finisher()

    def on_shard(job) -> None:
        finisher.submit(finish, job)

    def on_sample(tokens: int) -> None:
        progress.update(1, tokens)

    log.info("loading the verifier %s (%s backend, %s)", io.verifier, p.backend, plan.dtype)
    try:
        run_backend(io, p, plan, todo, storage, progress, on_sample, on_shard, ready)
        finisher.wait()
    finally:
        finisher.close()


def run_backend(io, p, plan: Plan, todo, storage, progress, on_sample, on_shard, ready) -> None:
    if p.backend == "transformers":
        dtype = TORCH_DTYPES[plan.dtype]
        extractor = TransformersExtractor(io.verifier, dtype, plan.aux_ids, p.use_gpus)
        progress.start = time.monotonic()
        progress.update(0, force=True)
        if ready is not None:  # one shard at a time: wait before reading the next one's samples
            todo = wait_ready(todo, ready)
        extractor.run(shard_jobs(io, plan, todo), plan.hidden_size, storage, on_sample, on_shard)
        progress.log()
    else:
        scratch = io.shard_dir / f".requests-job{io.job_index}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        layer_list = plan.aux_ids + [plan.num_layers]
        llm = engine.make_llm(
            vllm_engine_args(io.verifier, p, plan.dtype, layer_list, scratch),
            use_gpus=p.use_gpus,
        )
        try:
            progress.start = time.monotonic()
            progress.update(0, force=True)
            run_vllm(
                llm,
                shard_jobs(io, plan, todo),
                batch_size_samples=p.batch_size_samples,
                batch_budget_tokens=p.batch_budget_tokens,
                extract=True,
                num_aux=len(plan.aux_ids),
                hidden_size=plan.hidden_size,
                storage=storage,
                on_sample=on_sample,
                on_shard=on_shard,
                ready=None if ready is None else (lambda job: ready(job.extra["plan"])),
            )
            progress.log()
        finally:
            engine.close_llm(llm)
            shutil.rmtree(scratch, ignore_errors=True)
