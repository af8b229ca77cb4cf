"""The run's estimate at dry-run (lib/hidden_states/estimate.py, rules/common.smk): the verifier
tokens and the hidden states' bytes from prepare's counts, the extract job's disk plan to the
byte but for the shards' headers (held to their bound), only from the counts of the current
settings, a warning naming extract.disk_budget when the disk is short, and how to get it early;
on the mechanics build, against the bytes the extraction wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from tests import factories
from tests.workflow_runner import copy_workflow, dry_run_in_process, jobs_in
from workflow_scripts.lib.hidden_states import estimate as estimate_module
from workflow_scripts.lib.hidden_states.disk_plan import STORAGE_CHOICES, disk_plan
from workflow_scripts.lib.hidden_states.estimate import (
    HEADER_BYTES,
    STORAGE_CHOICES as STORAGE_WITHOUT_TORCH,
    Counts,
    dry_run_report,
    prepared_counts,
    shard_set_bytes,
)
from workflow_scripts.lib.hidden_states.shard_plan import Plan, ShardPlan, fingerprint, shard_key
from workflow_scripts.lib.hidden_states.manifest import LAYER_CONVENTION, shard_name
from workflow_scripts.lib.hidden_states.shards import TORCH_DTYPES, shard_layout
from workflow_scripts.lib.workflow.config import layered, load_config
from workflow_scripts.lib.workflow.definitions import PrepareParams
from workflow_scripts.lib.workflow.layout import Layout

# --------------------------------------------------------------------------- the bytes


def extraction_plan(lengths, final_rows, shard_size, aux_ids, hidden, dtype, storage) -> Plan:
    """An extraction plan of these samples as make_plan lays them out (no data on disk)."""
    cfg = {"num_hidden_layers": 40, "hidden_size": hidden, "vocab_size": 1000}
    key = {
        "verifier": "v" * 64,
        "aux_layer_ids": aux_ids,
        "dtype": dtype,
        "code": "c" * 64,
    }
    plan = Plan(Path("v"), cfg, aux_ids, dtype, storage, {}, key, None, len(lengths))
    for index, start in enumerate(range(0, len(lengths), shard_size)):
        ids = list(range(start, min(start + shard_size, len(lengths))))
        shard = ShardPlan(index, start, ids[-1] + 1, ids, [], [], Path(shard_name(index)))
        shard.lengths = [int(lengths[i]) for i in ids]
        shard.sample_final_rows = [int(final_rows[i]) for i in ids]
        shard.final_rows = sum(shard.sample_final_rows)
        shard.fingerprint = fingerprint(shard_key(key, storage), shard)
        plan.shards.append(shard)
    return plan


@pytest.mark.parametrize("storage", STORAGE_CHOICES)
@pytest.mark.parametrize("aux_ids", [[2, 20, 37], [5]])
def test_the_estimate_is_the_disk_plan_to_the_byte_but_for_headers(storage, aux_ids):
    rng = np.random.default_rng(len(aux_ids))
    lengths = rng.integers(8, 3000, 1001)
    final_rows = (lengths * rng.uniform(0.1, 0.9, len(lengths))).astype(int)
    plan = extraction_plan(lengths, final_rows, 64, aux_ids, 96, "float32", storage)
    exact = disk_plan(plan)["by_storage_dtype"][storage]["bytes"]  # the extract job's figure
    headers = sum(
        shard_layout(
            len(s.samples),
            s.num_tokens,
            s.final_rows,
            len(aux_ids),
            96,
            TORCH_DTYPES[storage],
            plan.shard_metadata(s),
        ).data_start
        for s in plan.shards
    )
    counts = Counts(len(lengths), int(lengths.sum()), int(final_rows.sum()))
    estimate, shards = shard_set_bytes(counts, 64, len(aux_ids), 96, storage)
    assert shards == len(plan.shards) == 16
    assert STORAGE_WITHOUT_TORCH == STORAGE_CHOICES
    assert estimate - shards * HEADER_BYTES == exact - headers
    assert 0 < estimate - exact <= shards * HEADER_BYTES


def test_a_shards_header_stays_within_its_bound():
    """The largest header a shard can have but for skipped samples: float8 (two more tensors),
    sixteen auxiliary layers, counts of a trillion tokens."""
    meta = {
        "fingerprint": "f" * 64,
        "sample_start": str(10**12),
        "sample_end": str(10**12 + 4096),
        "skipped_samples": "[]",
        "aux_layer_ids": json.dumps(list(range(100, 116))),
        "final_layer_id": "1000",
        "layer_convention": LAYER_CONVENTION,
        "dtype": "bfloat16",
        "storage_dtype": "float8_e4m3fn",
        "format_version": "100",
    }
    layout = shard_layout(4096, 10**12, 10**12, 16, 65536, TORCH_DTYPES["float8_e4m3fn"], meta)
    assert layout.data_start <= HEADER_BYTES


# --------------------------------------------------------------------------- prepare's counts


def prepared(tmp_path: Path, **stats) -> dict[str, Path]:
    """A results directory as prepare leaves it (its stats as prepare.py writes them), the chat
    data written before it, relative to the working directory (as Snakemake's rules name them)."""
    paths = {
        "chat_data": Path("results/data/chat_data.jsonl"),
        "verifier": Path("results/demo/verifier"),
        "stats": Path(str(Layout("results").prepare.stats)),
        "tokenized": Path(str(Layout("results").prepare.tokenized)),
    }
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    paths["verifier"].mkdir(exist_ok=True)
    paths["chat_data"].write_text("{}\n")
    paths["tokenized"].write_text("{}\n")
    p = PrepareParams()
    factories.prepare_stats(
        chat_data=str(paths["chat_data"]),
        verifier=str(paths["verifier"]),
        max_seq_len_tokens=p.max_seq_len_tokens,
        chat_template=p.chat_template.model_dump(),
        **stats,
    ).write(paths["stats"])
    return paths


def test_prepares_counts_are_taken_only_for_the_current_settings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = prepared(tmp_path, rows_out=12, tokens=3456, loss_masked_tokens=789)
    args = (paths["stats"], paths["tokenized"], paths["chat_data"], paths["verifier"])
    assert prepared_counts(*args, PrepareParams()) == (Counts(12, 3456, 789), None)

    assert prepared_counts(*args, PrepareParams(max_seq_len_tokens=100)) == (
        None,
        "prepare ran with another max_seq_len_tokens than the config gives",
    )
    other = (paths["stats"], paths["tokenized"], Path("results/regenerate/chat_data.jsonl"))
    counts, why = prepared_counts(*other, paths["verifier"], PrepareParams())
    assert counts is None and why == "prepare ran with another chat_data than the config gives"
    later = paths["stats"].stat().st_mtime + 10
    os.utime(paths["chat_data"], (later, later))
    counts, why = prepared_counts(*args, PrepareParams())
    assert counts is None and why == f"{paths['chat_data']} is newer than prepare's counts"
    assert prepared_counts(*args, PrepareParams(), dated=False) == (Counts(12, 3456, 789), None)
    paths["tokenized"].unlink()
    assert prepared_counts(*args, PrepareParams()) == (None, "prepare has not run")


def report(paths, config: dict, targets: list[str]) -> tuple[list[str], list[str]]:
    return dry_run_report(
        load_config(config),
        targets,
        Layout(paths["stats"].parent.parent),
        paths["verifier"],
        paths["chat_data"],
    )


def test_the_estimate_names_tokens_bytes_and_free_space(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a disk of 1 TiB free, whatever the machine running the test has
    usage = SimpleNamespace(total=2**40, used=0, free=2**40)
    monkeypatch.setattr(estimate_module.shutil, "disk_usage", lambda path: usage)
    paths = prepared(tmp_path, rows_out=1000, tokens=2_000_000, loss_masked_tokens=600_000)
    verifier = {"num_hidden_layers": 32, "hidden_size": 4096, "vocab_size": 128256}
    (paths["verifier"] / "config.json").write_text(json.dumps(verifier))
    config = {"extract": {"use_gpus": True, "storage_dtype": "bfloat16"}}

    lines, warnings = report(paths, config, ["draft_ckpt"])
    total, shards = shard_set_bytes(Counts(1000, 2_000_000, 600_000), 256, 3, 4096, "bfloat16")
    assert shards == 4 and warnings == []
    assert lines[3].startswith(f"  disk: 1.00 TiB free in {tmp_path / 'results'}")
    assert (
        lines[1]
        == "  extract: 1,000 samples, 2,000,000 verifier tokens (600,000 of them in the loss)"
    )
    assert lines[2].startswith(
        f"  hidden states: {total / 2**30:,.2f} GiB in 4 shard(s), stored in bfloat16"
    )
    assert "3 auxiliary layers [2, 16, 29]" in lines[2]
    assert lines[3].startswith("  disk: ") and " needed with extract.disk_margin 1.1" in lines[3]
    assert not any(line.startswith("  evaluate") for line in lines)
    lines, _ = report(paths, config, ["all"])
    assert lines[-2].startswith("  evaluate: at most 384 generated tokens per prompt turn")
    assert lines[-1] == (
        "  evaluate's speed passes: each engine serves every first turn at least 8 times more "
        "(concurrency [1, 4, 16, 64], each untimed then timed, the timed one again until "
        "evaluate.speed_pass_min_s 2 s), each set at least 64 requests a pass"
    )
    assert report(paths, config, ["vocab_map"]) == ([], [])  # extracts nothing: nothing shown

    # petabytes of states: more than any disk here; a warning naming the disk budget
    paths = prepared(tmp_path, rows_out=10**6, tokens=10**11, loss_masked_tokens=10**10)
    lines, warnings = report(paths, config, ["hidden_states"])
    assert len(warnings) == 1 and "set extract.disk_budget (e.g. '90%'" in warnings[0]
    assert "(extract.storage_dtype float8_e4m3fn: " in warnings[0]
    fp8 = layered(config, {"extract": {"storage_dtype": "float8_e4m3fn"}})
    lines, warnings = report(paths, fp8, ["hidden_states"])
    assert len(warnings) == 1 and "extract.storage_dtype" not in warnings[0]
    budget = layered(config, {"extract": {"disk_budget": "2TB"}})
    lines, warnings = report(paths, budget, ["draft_ckpt"])
    assert warnings == [] and "extract.disk_budget '2TB': training keeps at most that" in lines[3]

    paths["tokenized"].unlink()
    lines, warnings = report(paths, config, ["draft_ckpt"])
    assert warnings == [] and lines == [
        "Run estimate (verifier tokens, hidden states' bytes on disk): prepare has not run; to "
        "get it before the run, build prepare (it tokenizes the chat data, no model loads) with "
        "`snakemake --cores all prepare`, then `snakemake -n draft_ckpt`"
    ]


# --------------------------------------------------------------------------- in the workflow


@pytest.mark.workflow
def test_before_prepare_the_dry_run_says_how_to_get_the_estimate(tmp_path):
    """On a fresh copy of the embedded default: the line, and its first command builds prepare
    (and what it needs) and nothing that loads the verifier for extraction."""
    work = copy_workflow(tmp_path / "wf")
    error, out = dry_run_in_process(work, "draft_ckpt", {})
    assert error is None, out[-3000:]
    assert "`snakemake --cores all prepare`, then `snakemake -n draft_ckpt`" in out
    error, out = dry_run_in_process(work, "prepare", {})
    assert error is None, out[-3000:]
    assert set(jobs_in(out)) == {"demo", "data", "prepare"}
    assert "Run estimate" not in out  # prepare extracts nothing


@pytest.mark.workflow
def test_the_dry_run_estimate_is_what_the_extraction_wrote(mechanics_build, monkeypatch):
    work, config = mechanics_build
    manifest = json.loads((Layout(work / "results").extract.manifest).read_text())
    stats = json.loads((Layout(work / "results").prepare.stats).read_text())
    verifier = json.loads((work / "results" / "demo" / "verifier" / "config.json").read_text())
    cfg = load_config(layered(yaml.safe_load((work / "config.yaml").read_text()), config))
    counts = Counts(stats["rows_out"], stats["tokens"], stats["loss_masked_tokens"])
    assert counts.tokens == manifest["num_tokens"] and counts.samples == manifest["num_samples"]
    assert counts.loss_tokens == manifest["disk"]["final_rows"]  # no sample starts in the loss
    aux, hidden = len(manifest["aux_layer_ids"]), verifier["hidden_size"]
    for storage, figures in manifest["disk"]["by_storage_dtype"].items():
        estimate, shards = shard_set_bytes(
            counts, cfg.extract.shard_size_samples, aux, hidden, storage
        )
        assert shards == len(manifest["shards"])
        assert 0 < estimate - figures["bytes"] <= shards * HEADER_BYTES, storage
    estimate, shards = shard_set_bytes(
        counts, cfg.extract.shard_size_samples, aux, hidden, manifest["storage_dtype"]
    )
    assert 0 < estimate - manifest["bytes"] <= shards * HEADER_BYTES  # the files' real bytes

    monkeypatch.chdir(work)
    lines, warnings = dry_run_report(
        cfg,
        ["draft_ckpt"],
        Layout("results"),
        Layout("results").demo.verifier,
        Layout("results").regenerate.chat_data,
    )
    assert warnings == [] and lines[1].startswith(f"  extract: {counts.samples:,} samples")
    error, out = dry_run_in_process(work, "draft_ckpt", config)
    assert error is None, out[-3000:]
    shown = "\n".join(lines[:3])  # the free space may change between the two
    assert shown in out and "  regenerate (done): " in out

    changed = layered(config, {"prepare": {"max_seq_len_tokens": 300}})
    error, out = dry_run_in_process(work, "draft_ckpt", changed)
    assert error is None, out[-3000:]
    assert "prepare ran with another max_seq_len_tokens than the config gives" in out
    assert "build regeneration and prepare" in out and "Run estimate, from" not in out
