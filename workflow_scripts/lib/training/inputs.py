"""Training's inputs, checked before anything expensive: the extraction manifest against the
verifier (hidden size, layer count and ids, vocabulary, the verifier's identity), the vocab map
against the verifier's vocabulary, every shard's presence and checksum, the verifier tensors the
draft needs. Each problem stops the run with a message naming it. Also the fingerprint a
resumable training state must carry.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from workflow_scripts.lib.common import (
    UserError,
    atomic_path,
    format_seconds,
    sha256_file,
)
from workflow_scripts.lib.training import init_from
from workflow_scripts.lib.hidden_states.manifest import load_manifest
from workflow_scripts.lib.hidden_states.records import Manifest, StreamPlan
from workflow_scripts.lib.training.loader import SampleIndex
from workflow_scripts.lib.training.disk_budget import load_stream_plan
from workflow_scripts.lib.training.processes import Dist
from workflow_scripts.lib.training.stream_consumer import StreamedIndex, engine_command
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.code_inputs import resume_key, stage_fingerprint
from workflow_scripts.lib.workflow.definitions import TrainParams
from workflow_scripts.lib.workflow.registry import TrainIO

log = logging.getLogger("eagle3")

VERIFIED_FILE = "verified_shards.json"


@dataclass
class Inputs:
    """Everything checked before the first step."""

    verifier_cfg: dict[str, Any]
    manifest: Manifest | StreamPlan
    aux_layer_ids: list[int]  # ascending: the order vLLM concatenates them in
    aux_order: list[int] | None  # permutation of the shards' aux axis into that order, if needed
    d2t: torch.Tensor
    t2d: torch.Tensor
    tensors: dict[str, tuple[Path, str]]  # embed / norm / lm_head -> (file, tensor name)
    index: "SampleIndex | StreamedIndex"
    fingerprint: str
    streamed: bool = False  # extract.disk_budget: the states are computed while training runs


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


def verify_shard_checksums(manifest: Manifest, state_dir: Path, d: Dist | None = None) -> None:
    """sha256 of every shard against the manifest, in parallel threads. Results are remembered
    in the state dir by (size, mtime), so a resumed run does not hash terabytes again. With
    ``d`` (training over several nodes) the shards are shared out over every process of every
    node, each hashing its share as its node sees it, and every process learns every result."""
    cache_path = state_dir / VERIFIED_FILE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, json.JSONDecodeError):
        cache = {}

    def key(entry):
        st = os.stat(entry.path)
        return [st.st_size, st.st_mtime_ns, entry.sha256]

    todo = [e for e in manifest.shards if cache.get(e.path) != key(e)]
    shared = d is not None and d.distributed
    mine = todo[d.rank :: d.world] if shared else todo
    if not todo:
        return
    started = time.monotonic()
    log.info(
        "verifying the checksums of %d shard(s)%s",
        len(todo),
        f" over {d.world} processes ({len(mine)} here)" if shared else "",
    )
    workers = max(1, min(8, len(mine), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda e: sha256_file(e.path), mine))
    results = [(e.path, key(e), digest == e.sha256) for e, digest in zip(mine, digests)]
    if shared:
        gathered: list[Any] = [None] * d.world
        dist.all_gather_object(gathered, results)
        results = [r for part in gathered for r in part]
    for path, _, ok in results:
        if not ok:
            raise UserError(
                f"shard {path} does not match its checksum in the manifest (corrupt or "
                "overwritten); delete it and re-run extraction"
            )
    log.info("checksums verified in %s", format_seconds(time.monotonic() - started))
    if d is None or d.main:
        cache.update({path: k for path, k, _ in results})
        state_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(cache_path) as tmp:
            tmp.write_text(json.dumps(cache))
    if shared:
        d.barrier()


def check_same_view(inputs: "Inputs", d: Dist) -> None:
    """Training over several nodes: every process must read the same inputs, so the results
    directory must lie on a file system all nodes share. Each process reports its host, the
    fingerprint of its inputs (manifest, vocab map, verifier, settings) and the size of every
    shard as it sees them; any that differ from node 0's stop every process, naming both."""
    sizes = []
    for entry in inputs.manifest.shards:
        try:
            sizes.append(os.stat(entry.path).st_size)
        except OSError:
            sizes.append(None)
    mine = {"host": socket.gethostname(), "fingerprint": inputs.fingerprint, "sizes": sizes}
    views: list[Any] = [None] * d.world
    dist.all_gather_object(views, mine)
    first = views[0]
    for rank, view in enumerate(views):
        if view["fingerprint"] != first["fingerprint"] or view["sizes"] != first["sizes"]:
            what = "shard files" if view["fingerprint"] == first["fingerprint"] else "inputs"
            raise UserError(
                f"process {rank} on {view['host']} sees other {what} than process 0 on "
                f"{first['host']} (the manifest, vocab map, verifier and every shard's size are "
                "compared): training over several nodes reads them from one shared file system. "
                "Put results_dir (and the verifier) on a path every node mounts "
                "(docs/training.md#several-nodes)"
            )
    if d.main:
        hosts = sorted({v["host"] for v in views})
        log.info(
            "every process sees the same inputs (%d shard(s)) on %d host(s): %s",
            len(sizes),
            len(hosts),
            ", ".join(hosts),
        )


def run_fingerprint(io: TrainIO, p: TrainParams) -> str:
    """What a resumable state must have been trained from: its result settings (every one:
    num_speculative_tokens too, which decides the weights kept), input contents and the
    fingerprint of the training code (a state the old code made is not resumed). States saved
    under other execution settings are resumed."""
    settings = p.result_settings()
    files = {
        "manifest": sha256_file(io.manifest),
        "vocab_map": sha256_file(io.vocab_map),
        "verifier": verifier_files.fingerprint(io.verifier),
        "init_from": [sha256_file(f) for f in init_from.files(p.init_from)],
    }
    return resume_key({"settings": settings, "files": files}, stage_fingerprint("train"))


def check_inputs(
    io: TrainIO, p: TrainParams, verify_checksums: bool = True, d: Dist | None = None
) -> Inputs:
    vcfg = verifier_files.verifier_config(io.verifier)
    V = int(vcfg["vocab_size"])
    streamed = bool(io.engine_cmd)
    if streamed:  # the engine's plan of every shard; the shards come while training runs
        manifest = load_stream_plan(Path(io.manifest))
        shard_dir = Path(engine_command(io.engine_cmd)[1].shard_dir)
    else:
        manifest = load_manifest(io.manifest)  # every shard present
    manifest.check_against(vcfg, Path(io.verifier), Path(io.manifest))
    d2t, t2d = check_vocab_map(Path(io.vocab_map), V)
    if verify_checksums and not streamed:
        verify_shard_checksums(manifest, Path(io.state_dir), d)
    tensors = verifier_files.locate_tensors(Path(io.verifier), vcfg)
    aux = list(manifest.aux_layer_ids)
    ascending = sorted(aux)
    aux_order = None if aux == ascending else [aux.index(i) for i in ascending]
    if streamed:
        index = StreamedIndex(manifest, shard_dir, aux_order, p.micro_batch_budget_tokens)
    else:
        index = SampleIndex(manifest, aux_order, p.micro_batch_budget_tokens)
    if p.num_gpus > 0 and torch.cuda.device_count() < p.num_gpus:
        raise UserError(
            f"train.num_gpus is {p.num_gpus} but {torch.cuda.device_count()} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    if p.draft_attention == "mla" and not verifier_files.uses_mla(vcfg):
        raise UserError(
            f"train.draft_attention is mla, but the verifier {io.verifier} has no multi-head "
            "latent attention (no kv_lora_rank and qk_rope_head_dim in its config): an MLA "
            "draft takes the verifier's MLA shape; set train.draft_attention: llama"
        )
    if p.init_from is not None:
        init_from.check_init_draft(p.init_from, p, vcfg, sorted(manifest.aux_layer_ids))
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
        streamed=streamed,
    )
