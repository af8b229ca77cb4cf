"""Hidden-state extraction: real vLLM (CPU build) on a small random Llama, through the script's
own entry point; the transformers reference; resume after a kill; data parallel; preflight.

Engine starts are the cost here (~30 s each): one job killed and resumed, tensor parallel workers
and the transformers reference share one verifier and one data file. Two data-parallel jobs under
Snakemake, held against one job's states: tests/test_slurm.py (each a SLURM job) and
tests/test_reruns.py (the job count changed, nothing recomputed).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests import factories
from tests.processes import kill_when
from tests.stage_process import run_stage
from tests.tokenizers_for_tests import build_chatml_tokenizer
from workflow_scripts.lib.common import UserError, sha256_file
from workflow_scripts.lib.hidden_states.extraction import make_plan
from workflow_scripts.lib.hidden_states.manifest import LAYER_CONVENTION, load_manifest
from workflow_scripts.lib.hidden_states.manifest import merge_parts as merge
from workflow_scripts.lib.hidden_states.records import ExtractPart, Manifest
from workflow_scripts.lib.hidden_states.shard_writer import ShardWriter
from workflow_scripts.lib.hidden_states.shards import ShardReader, read_positions, shard_fingerprint
from workflow_scripts.lib.hidden_states.stream_producer import (
    all_shards_plan,
    read_heldout_shard,
    stream_plan,
)
from workflow_scripts.lib.training.disk_budget import SampleTable
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.definitions import ExtractParams
from workflow_scripts.stages import extract
from workflow_scripts.lib.workflow.layout import MANIFEST

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1000
LAYERS = 8
MAX_LEN = 256
SHARD = 8

# Small, CPU-friendly engine settings (other jobs share this machine).
TEST_PARAMS = dict(
    use_gpus=False,
    dtype="float32",
    gpu_memory_utilization=0.05,
    kv_cache_memory_bytes=256 << 20,
    enforce_eager=True,
    shard_size_samples=SHARD,
    batch_size_samples=8,
    batch_budget_tokens=1024,
    max_model_len_tokens=MAX_LEN,
    on_too_long="skip",
    progress_interval_s=1.0,
)


def make_verifier(path: Path, layers: int = LAYERS, weights: bool = True) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if weights:
        model = LlamaForCausalLM(cfg)
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(path)
        build_chatml_tokenizer(path)  # for the workflow's checks; extraction needs none
    else:
        path.mkdir(parents=True, exist_ok=True)
        cfg.architectures = ["LlamaForCausalLM"]
        cfg.to_json_file(path / "config.json")
    return path


def write_rows(path: Path, lengths: list[int], seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as fh:
        for i, n in enumerate(lengths):
            ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
            mask = torch.randint(0, 2, (n,), generator=g).tolist()
            fh.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return path


# 60 samples -> 8 shards (the last one short); sample 13 has the longest length vLLM accepts
# (max_model_len - 1), sample 21 is too long and is skipped and counted.
LENGTHS = [20 + (37 * i) % 180 for i in range(60)]
LENGTHS[13] = MAX_LEN - 1
LENGTHS[21] = MAX_LEN + 40


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    verifier = make_verifier(root / "verifier")
    tokenized = write_rows(root / "tokenized_data.jsonl", LENGTHS)
    return root, verifier, tokenized


def files(root: Path, verifier: Path, tokenized: Path, out: Path, job: int) -> dict:
    return {
        "tokenized": tokenized,
        "verifier": verifier,
        "shard_dir": out / "shards",
        "job_index": job,
        "part": out / "parts" / f"part_{job}.json",
    }


ENTRY = "workflow_scripts.stages.extract"


def command(p: ExtractParams, f: dict) -> list[str]:
    return [sys.executable, "-m", ENTRY, *shlex.split(cli.render("extract", p, f))]


def run_job(
    p: ExtractParams, f: dict, timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    proc = run_stage(ENTRY, command(p, f)[3:], ROOT, {**os.environ, **(env or {})}, timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def merged(out: Path, num_jobs: int) -> Manifest:
    parts = [out / "parts" / f"part_{j}.json" for j in range(num_jobs)]
    merge([(p, ExtractPart.read(p)) for p in parts], out / MANIFEST).write(out / MANIFEST)
    return load_manifest(out / MANIFEST, verify_checksums=True)


def tensors(manifest: Manifest) -> dict[str, torch.Tensor]:
    """All samples of a manifest, concatenated per tensor."""
    out: dict[str, list[torch.Tensor]] = {}
    for entry in manifest.shards:
        reader = ShardReader(Path(entry.path))
        for i in range(len(reader)):
            s = reader.sample(i)
            for name in ("aux_hidden_states", "final_hidden_states", "input_ids", "loss_mask"):
                out.setdefault(name, []).append(getattr(s, name))
    return {k: torch.cat(v) for k, v in out.items()}


def stat_key(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


# --------------------------------------------------------------------------- vLLM, resume


@pytest.fixture(scope="module")
def resumed(world):
    """One vLLM job killed (SIGKILL, its whole process group) after its second finished shard,
    then a finished shard truncated and a stray partial file planted, then the job rerun."""
    root, verifier, tokenized = world
    out = root / "one_job"
    f = files(root, verifier, tokenized, out, 0)
    shard_dir = out / "shards"
    # one sample per engine step: slow enough to be killed half-way
    slow = ExtractParams(**{**TEST_PARAMS, "batch_size_samples": 1, "batch_budget_tokens": 256})
    kill_when(
        command(slow, f),
        ROOT,
        lambda: len(list(shard_dir.glob("shard_*.safetensors"))) >= 2,
        240,
        "two finished shards",
    )
    finished = sorted(shard_dir.glob("shard_*.safetensors"))
    partial = sorted(shard_dir.glob(".shard_*.tmp-*"))
    assert 2 <= len(finished) < 8, "the kill came too late to test a resume"
    assert not (out / "parts" / "part_0.json").exists()

    kept, truncated = finished[0], finished[1]
    before = {p.name: stat_key(p) for p in finished}
    with open(truncated, "r+b") as fh:
        fh.truncate(truncated.stat().st_size // 2)
    stray = shard_dir / ".shard_000007.safetensors.tmp-999999"
    stray.write_bytes(b"partial")

    proc = run_job(ExtractParams(**TEST_PARAMS), f)
    return {
        "out": out,
        "files": f,
        "log": proc.stderr,
        "finished_at_kill": finished,
        "partial_at_kill": partial,
        "kept": kept,
        "truncated": truncated,
        "before": before,
        "manifest": merged(out, 1),
    }


@pytest.mark.engine
def test_killed_job_resumes_only_unfinished_shards(resumed):
    shard_dir = resumed["out"] / "shards"
    kept, truncated = resumed["kept"], resumed["truncated"]
    # the untouched finished shard was reused as it was; the truncated one was recomputed
    assert stat_key(kept) == resumed["before"][kept.name]
    assert stat_key(truncated) != resumed["before"][truncated.name]
    n_finished = len(resumed["finished_at_kill"]) - 1
    assert f"{n_finished} finished already, {8 - n_finished} to compute" in resumed["log"]
    # no partial file is left, none was taken for a shard
    assert not list(shard_dir.glob(".shard_*.tmp-*"))
    assert not list(shard_dir.glob(".requests-job*"))
    manifest = resumed["manifest"]
    assert [e.index for e in manifest.shards] == list(range(8))
    for entry in manifest.shards:
        assert shard_fingerprint(Path(entry.path)) == entry.fingerprint


@pytest.mark.engine
def test_manifest_records_layers_verifier_and_skips(resumed, world):
    _, verifier, tokenized = world
    m = resumed["manifest"]
    assert m.aux_layer_ids == [2, 4, 5] and m.final_layer_id == LAYERS
    assert m.layer_convention == LAYER_CONVENTION
    assert m.dtype == "float32" and m.hidden_size == 128 and m.num_hidden_layers == LAYERS
    assert m.verifier.config_sha256 == sha256_file(verifier / "config.json")
    assert m.tokenized.sha256 == sha256_file(tokenized)
    assert m.num_skipped_too_long == 1 and m.skipped_too_long == [21]
    assert m.num_samples == len(LENGTHS) - 1
    assert m.num_tokens == sum(LENGTHS) - LENGTHS[21]
    t = tensors(m)
    rows = [json.loads(line) for line in tokenized.read_text().splitlines()]
    kept = [r for i, r in enumerate(rows) if i != 21]
    assert t["input_ids"].tolist() == [x for r in kept for x in r["input_ids"]]
    assert t["loss_mask"].tolist() == [x for r in kept for x in r["loss_mask"]]
    assert t["aux_hidden_states"].shape == (m.num_tokens, 3, 128)
    assert t["final_hidden_states"].shape == (m.num_tokens, 128)
    # the shard metadata carries the layers and their convention too
    from safetensors import safe_open

    with safe_open(m.shards[0].path, framework="pt") as fh:
        meta = fh.metadata()
    assert json.loads(meta["aux_layer_ids"]) == [2, 4, 5] and meta["final_layer_id"] == "8"
    assert meta["layer_convention"] == LAYER_CONVENTION


@pytest.mark.engine
def test_bytes_per_token_near_floor(resumed):
    """The floor: 3 aux layers x hidden x float32 per token, and the final state where the loss
    reads it (before each assistant token)."""
    m = resumed["manifest"]
    floor = 3 * 128 * 4 * m.num_tokens
    final_rows = 0
    for entry in m.shards:
        reader = ShardReader(Path(entry.path))
        final_rows += sum(
            len(read_positions(reader.sample(i).loss_mask)) for i in range(len(reader))
        )
    floor += final_rows * 128 * 4
    assert final_rows < 0.6 * m.num_tokens  # random masks: about half the positions
    assert floor <= m.bytes <= floor * 1.02


@pytest.mark.engine
def test_finished_job_reruns_without_loading_the_model(resumed):
    proc = run_job(ExtractParams(**TEST_PARAMS), resumed["files"])
    assert "nothing to compute: the model is not loaded" in proc.stderr
    assert "8 finished already, 0 to compute" in proc.stderr
    part = json.loads(Path(resumed["files"]["part"]).read_text())
    assert [e["sha256"] for e in part["shards"]] == [e.sha256 for e in resumed["manifest"].shards]


# --------------------------------------------------------------------------- reference backend


@pytest.mark.engine
def test_transformers_backend_matches_vllm(resumed, world):
    """Same shards from the reference backend; every tensor within 1e-4 in float32, the final
    pre-norm state included."""
    root, verifier, tokenized = world
    out = root / "transformers"
    run_job(
        ExtractParams(**{**TEST_PARAMS, "backend": "transformers"}),
        files(root, verifier, tokenized, out, 0),
    )
    ref, got = tensors(merged(out, 1)), tensors(resumed["manifest"])
    assert torch.equal(ref["input_ids"], got["input_ids"])
    assert torch.equal(ref["loss_mask"], got["loss_mask"])
    for name in ("aux_hidden_states", "final_hidden_states"):
        diff = (ref[name] - got[name]).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs difference {diff}"
    # the final state is before the norm: the normed one differs a lot
    model = LlamaForCausalLM.from_pretrained(verifier).eval()
    first = torch.tensor(json.loads(tokenized.read_text().splitlines()[0])["input_ids"])
    with torch.inference_mode():
        post_norm = model(first[None], output_hidden_states=True).hidden_states[-1][0]
    assert (post_norm - got["final_hidden_states"][: len(first)]).abs().max() > 0.1


# --------------------------------------------------------------------------- data parallel


@pytest.mark.engine
@pytest.mark.pinned
def test_tensor_parallel_extraction_equals_one_worker(resumed, world, tmp_path):
    """extract.tensor_parallel_size 2 on the CPU, two vLLM workers each bound to a core by the
    stage itself: the shards equal the one-worker shards (1e-6 relative), and one worker (rank
    0) writes each sample, once."""
    from workflow_scripts.lib.hidden_states.connector import WRITE_LOG_ENV

    root, verifier, tokenized = world
    out = tmp_path / "tp2"
    writes = tmp_path / "writes.log"
    p = ExtractParams(**{**TEST_PARAMS, "tensor_parallel_size": 2})
    proc = run_job(p, files(root, verifier, tokenized, out, 0), env={WRITE_LOG_ENV: str(writes)})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # the stage bound the workers itself
    one, two = tensors(resumed["manifest"]), tensors(merged(out, 1))
    for name in ("input_ids", "loss_mask"):
        assert torch.equal(one[name], two[name])
    for name in ("aux_hidden_states", "final_hidden_states"):
        scale = one[name].abs().max()
        assert (one[name] - two[name]).abs().max() <= 1e-6 * scale, name
    lines = [line.split() for line in writes.read_text().splitlines()]
    assert len({pid for pid, _, _ in lines}) == 1, "more than one worker wrote"
    requests = [req for _, req, _ in lines]
    assert len(requests) == len(set(requests)) == resumed["manifest"].num_samples
    assert sum(int(n) for _, _, n in lines) == resumed["manifest"].num_tokens
    assert "2 local" not in proc.stderr  # no NUMA binding failure


# --------------------------------------------------------------------------- preflight


@pytest.fixture(scope="module")
def small_verifier(tmp_path_factory):
    """A 6-layer config (the default layers collide: [2, 3, 3]) with a placeholder weight file."""
    path = make_verifier(tmp_path_factory.mktemp("v6") / "verifier", layers=6, weights=False)
    (path / "model.safetensors").write_bytes(b"not loaded before the checks pass")
    return path


def preflight_error(monkeypatch, world, tmp_path, verifier=None, lengths=None, **overrides) -> str:
    """Run the script's main in-process; return the UserError message. The model must not load."""
    root, default_verifier, tokenized = world
    if lengths is not None:
        tokenized = write_rows(tmp_path / "data.jsonl", lengths)
    p = ExtractParams(**{**TEST_PARAMS, **overrides})
    f = files(root, verifier or default_verifier, tokenized, tmp_path / "out", 0)
    from workflow_scripts.lib.hidden_states import extract_engines as extraction_engines
    from workflow_scripts.lib.verifier import engine

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the checks failed")

    monkeypatch.setattr(engine, "make_llm", no_model)
    monkeypatch.setattr(extraction_engines, "TransformersExtractor", no_model)
    monkeypatch.setattr(sys, "argv", command(p, f)[2:])
    with pytest.raises(UserError) as err:
        extract.main()
    assert not (tmp_path / "out" / "parts").exists() or not list(
        (tmp_path / "out" / "parts").iterdir()
    )
    return str(err.value)


PREFLIGHT_CASES = [
    ("default_layers_collide", r"\[2, 3, 3\].*repeats a layer.*extract\.aux_layer_ids"),
    ("duplicate_layers", r"repeats a layer.*extract\.aux_layer_ids"),
    ("layer_out_of_range", r"\[8\] out of range.*0\.\.7.*extract\.aux_layer_ids"),
    ("no_weights", r"no weights"),
    ("empty_data", r"is empty: nothing to extract"),
    (
        "too_long_fail",
        r"1 sample\(s\).*line 2 \(300 tokens\).*extract\.max_model_len_tokens.*on_too_long: skip",
    ),
    (
        "too_few_gpus",
        r"extract\.tensor_parallel_size is 2.*0 GPU\(s\) are visible.*extract\.use_gpus",
    ),
    (
        "tp_not_dividing_heads",
        r"extract\.tensor_parallel_size 4 does not divide.*2 attention heads",
    ),
    ("token_outside_vocab", r"token id 5000 is outside the verifier's vocabulary of 1000"),
    ("job_index_past_num_jobs", r"job index 3 is not below extract\.num_jobs 1"),
    (
        "max_len_past_positions",
        r"extract\.max_model_len_tokens 1024 exceeds.*max_position_embeddings 512",
    ),
]


@pytest.mark.parametrize("case, expected", PREFLIGHT_CASES, ids=[c for c, _ in PREFLIGHT_CASES])
def test_preflight_fails_before_the_model_loads(
    case, expected, monkeypatch, world, small_verifier, tmp_path
):
    import re

    kw: dict = {}
    if case == "default_layers_collide":
        kw = dict(verifier=small_verifier)
    elif case == "duplicate_layers":
        kw = dict(aux_layer_ids=[2, 4, 4])
    elif case == "layer_out_of_range":
        kw = dict(aux_layer_ids=[2, 4, 8])
    elif case == "no_weights":
        kw = dict(verifier=make_verifier(tmp_path / "noweights", weights=False))
    elif case == "empty_data":
        kw = dict(lengths=[])
    elif case == "too_long_fail":
        kw = dict(lengths=[10, 300, 20], on_too_long="fail")
    elif case == "too_few_gpus":
        kw = dict(use_gpus=True, tensor_parallel_size=2, dtype="bfloat16")
    elif case == "tp_not_dividing_heads":
        kw = dict(tensor_parallel_size=4)
    elif case == "token_outside_vocab":
        data = tmp_path / "bad.jsonl"
        data.write_text(json.dumps({"input_ids": [1, 5000], "loss_mask": [0, 1]}) + "\n")
        root, verifier, _ = world
        p = ExtractParams(**TEST_PARAMS)
        monkeypatch.setattr(
            sys, "argv", command(p, files(root, verifier, data, tmp_path / "o", 0))[2:]
        )
        with pytest.raises(UserError) as err:
            extract.main()
        assert re.search(expected, str(err.value)), str(err.value)
        return
    elif case == "job_index_past_num_jobs":
        root, verifier, tokenized = world
        p = ExtractParams(**TEST_PARAMS)
        f = {**files(root, verifier, tokenized, tmp_path / "o", 0), "job_index": 3}
        monkeypatch.setattr(sys, "argv", command(p, f)[2:])
        with pytest.raises(UserError, match=expected):
            extract.main()
        return
    elif case == "max_len_past_positions":
        kw = dict(max_model_len_tokens=1024)
    msg = preflight_error(monkeypatch, world, tmp_path, **kw)
    assert re.search(expected, msg), msg


def test_preflight_error_through_the_entry_point(world, small_verifier, tmp_path):
    """The real command: exit status 2 and one clear line, before the model loads."""
    root, _, tokenized = world
    proc = subprocess.run(
        command(ExtractParams(**TEST_PARAMS), files(root, small_verifier, tokenized, tmp_path, 0)),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "extract.aux_layer_ids" in proc.stderr and "Traceback" not in proc.stderr
    assert "Loading weights" not in proc.stderr and "loading took" not in proc.stderr


# --------------------------------------------------------------------------- shard keys


def shard_fingerprints(world, tokenized: Path, out: Path) -> list[str]:
    root, verifier, _ = world
    io = SimpleNamespace(**files(root, verifier, tokenized, out, 0))
    return [s.fingerprint for s in make_plan(io, ExtractParams(**TEST_PARAMS)).shards]


def test_grown_data_keeps_every_full_shard_before_it(world, tmp_path):
    """A shard is keyed by its own samples: data grown at its end keeps the fingerprint of every
    full shard before the new samples (their states are reused), an edited sample changes only
    its shard's."""
    _, _, tokenized = world
    lines = tokenized.read_bytes().splitlines(keepends=True)
    before = shard_fingerprints(world, tokenized, tmp_path / "a")
    extra = write_rows(tmp_path / "extra.jsonl", [30] * 10, seed=1).read_bytes()
    grown = tmp_path / "grown.jsonl"
    grown.write_bytes(b"".join(lines) + extra)
    after = shard_fingerprints(world, grown, tmp_path / "b")
    assert len(before) == 8 and len(after) == 9  # 60 samples, then 70, 8 to a shard
    assert after[:7] == before[:7] and after[7] != before[7]  # the short last shard grew
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(b"".join(lines[:20] + [lines[20].replace(b'"s20"', b'"x20"')] + lines[21:]))
    edited_fingerprints = shard_fingerprints(world, edited, tmp_path / "c")
    assert [i for i in range(8) if edited_fingerprints[i] != before[i]] == [2]  # line 21: shard 2


def test_heldout_shards_are_keyed_alike_by_training_and_the_engine(world, tmp_path):
    """With a disk budget, training names each held-out shard's fingerprint from the stream plan
    (no data) and the engine from the data: the same, and another when a sample's shard changes."""
    _, _, tokenized = world
    lines = [3, 17, 40, 41]
    io = SimpleNamespace(**files(world[0], world[1], tokenized, tmp_path, 0))
    plan = all_shards_plan(tokenized, world[1], tmp_path / "shards", ExtractParams(**TEST_PARAMS))
    engine_side = read_heldout_shard(plan, 0, lines, tokenized, tmp_path)
    table = SampleTable(stream_plan(plan, io.shard_dir))
    val_ids = np.asarray([int(np.flatnonzero(table.lines == i)[0]) for i in lines])
    training_side, _ = table.heldout(stream_plan(plan, io.shard_dir), val_ids, tmp_path, 8)
    assert [s.fingerprint for s in training_side] == [engine_side.fingerprint]
    plan.shards[5].fingerprint = "other"  # sample 41's shard
    assert read_heldout_shard(plan, 0, lines, tokenized, tmp_path).fingerprint != (
        engine_side.fingerprint
    )


# --------------------------------------------------------------------------- format, merge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_writer_streams_out_of_order(tmp_path, dtype):
    lengths = [3, 5, 2]
    ids = [torch.randint(0, 100, (n,)) for n in lengths]
    masks = [torch.randint(0, 2, (n,)) for n in lengths]
    path = tmp_path / "shard_000000.safetensors"
    writer = ShardWriter(path, ids, masks, 3, 16, dtype, {"fingerprint": "f", "sample_start": "0"})
    states = {}
    for i in (2, 0, 1):
        states[i] = (
            torch.randn(lengths[i], 3, 16).to(dtype),
            torch.randn(lengths[i], 16).to(dtype),
        )
        writer.put(i, *states[i])
        assert not path.exists()  # only the temporary name until every sample is in
    entry = writer.finish()
    assert entry["num_samples"] == 3 and entry["num_tokens"] == 10 and not writer.tmp.exists()
    reader = ShardReader(path)
    for i, (aux, final) in states.items():
        s = reader.sample(i)
        read = torch.zeros(lengths[i], dtype=torch.bool)
        read[read_positions(masks[i])] = True  # the final states the loss reads, zeros elsewhere
        assert torch.equal(s.aux_hidden_states, aux)
        assert torch.equal(s.final_hidden_states, torch.where(read[:, None], final, 0).to(dtype))
        assert torch.equal(s.input_ids, ids[i]) and torch.equal(
            s.loss_mask, masks[i].to(torch.uint8)
        )
    assert shard_fingerprint(path) == "f"


def test_merge_refuses_parts_of_different_runs(tmp_path):
    a = factories.part(0, 2, num_shards=2)
    b = factories.part(1, 2, num_shards=2, dtype="bfloat16")
    with pytest.raises(UserError, match="disagree on dtype"):
        merge([(tmp_path / "a.json", a), (tmp_path / "b.json", b)], tmp_path / "m.json")
    with pytest.raises(UserError, match="expected one for each of 0..1"):
        merge([(tmp_path / "a.json", a)], tmp_path / "m.json")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_connector_gathers_what_the_stock_connector_would(dtype):
    """The block-wise copy of the cache-only layer's cache against vLLM's own token gather."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        extract_from_kv_cache,
    )

    from workflow_scripts.lib.hidden_states.connector import gather_states

    cache = torch.randn(20, 4, 16, 8).to(dtype)  # [blocks, layers, block_size, hidden]
    for blocks, tokens in (([5, 17, 3], 40), ([9], 16), ([4, 2], 17), ([1], 1)):
        b = torch.tensor(blocks)
        slots = (torch.arange(16)[None, :] + b[:, None] * 16).flatten()
        ref = extract_from_kv_cache(cache, slots, tokens)
        aux, final = gather_states(cache, blocks, 16, tokens)
        assert torch.equal(aux, ref[:, :-1]) and torch.equal(final, ref[:, -1])
        assert aux.is_contiguous() and final.is_contiguous() and aux.dtype == dtype
