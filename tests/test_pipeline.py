"""The whole workflow on the embedded default, end to end with real vLLM: regeneration,
extraction, training, evaluation and the report; then what a dry-run plans after real edits of
a built workflow."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.workflow_runner import planned, snakemake, write_config
from workflow_scripts.lib import cli
from workflow_scripts.lib.config import load_config

pytestmark = [pytest.mark.engine, pytest.mark.workflow]


@pytest.fixture(scope="module")
def pipeline(built_default):
    """The session's copy of the workflow, the embedded default built to the `evaluate` target
    (regeneration on)."""
    return built_default


def test_evaluation_results(pipeline):
    work, _ = pipeline
    results = json.loads((work / "results" / "evaluate" / "results.json").read_text())
    eagle, ngram = results["runs"]["eagle3"], results["runs"]["ngram"]
    assert results["num_prompts"] == 48 and results["num_speculative_tokens"] == 3
    # a trained draft on the predictable demo verifier is accepted most of the time
    assert eagle["mean_acceptance_length"] >= 2.5, results["summary"]
    assert len(eagle["acceptance_rate_per_position"]) == 3
    assert all(0 <= r <= 1 for r in eagle["acceptance_rate_per_position"])
    assert eagle["num_drafts"] > 0 and ngram["num_drafts"] > 0
    assert results["runs"]["baseline"]["output_tokens_per_s"] > 0
    # per prompt (vLLM's per-request metrics), pooled: the counters' figures, with an interval
    for run in (eagle, ngram):
        per_prompt = run["per_prompt"]
        assert per_prompt["mean_acceptance_length"] == pytest.approx(run["mean_acceptance_length"])
        lo, hi = per_prompt["mean_acceptance_length_ci95"]
        assert lo <= run["mean_acceptance_length"] <= hi and hi - lo < 1.0
        rates = per_prompt["acceptance_rate_per_position"]
        assert rates == pytest.approx(run["acceptance_rate_per_position"])
    # what training simulated on its held-out split, beside what vLLM measured
    simulated = results["simulated"]
    assert len(simulated["acceptance_rate_per_position"]) == 3
    assert abs(simulated["mean_acceptance_length"] - eagle["mean_acceptance_length"]) < 0.5
    assert results["summary"]["eagle3_simulated_acceptance_length"] == (
        simulated["mean_acceptance_length"]
    )
    # speculation is lossless at temperature 0: identical outputs, or the mismatch is listed
    assert results["greedy_lossless"] == (not any(results["greedy_mismatches"].values()))
    for name in ("acceptance_per_position", "draft_vs_ngram", "training_curves"):
        png = work / "results" / "evaluate" / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_report(pipeline, tmp_path):
    work, _ = pipeline
    report = work / "report.zip"
    snakemake(work, "evaluate", "--report", str(report))
    import zipfile

    names = zipfile.ZipFile(report).namelist()
    for expected in (
        "acceptance_per_position.png",
        "results.json",
        "config.resolved.yaml",
        "stats.json",
    ):
        assert any(n.endswith(expected) for n in names), (expected, names)


def test_nothing_is_redone(pipeline):
    work, _ = pipeline
    assert planned(work, "evaluate") == {}


def with_config(work: Path, config: dict, **changes) -> dict:
    new = {**config, **changes}
    write_config(work, new)
    return new


def test_training_change_reruns_training_only(pipeline):
    work, config = pipeline
    try:
        with_config(work, config, train={"epochs": 2})
        assert planned(work, "evaluate") == {"train": 1, "evaluate_draft": 1, "resolved_config": 1}
        assert planned(work, "draft_ckpt") == {"train": 1}
    finally:
        write_config(work, config)


def test_vocab_change_reruns_vocab_and_training_not_extraction(pipeline):
    work, config = pipeline
    try:
        with_config(work, config, vocab={"draft_vocab_size": 256})
        assert planned(work, "draft_ckpt") == {"vocab": 1, "train": 1}
    finally:
        write_config(work, config)


def test_extraction_change_reruns_extraction_and_training(pipeline):
    work, config = pipeline
    try:
        with_config(work, config, extract={"aux_layer_ids": [1, 3, 5]})
        assert planned(work, "draft_ckpt") == {"extract": 1, "extract_merge": 1, "train": 1}
    finally:
        write_config(work, config)


def test_training_code_change_reruns_training(pipeline):
    work, _ = pipeline
    path = work / "workflow_scripts" / "lib" / "draft_model.py"
    original = path.read_text()
    path.write_text(original + "\n# edited\n")
    try:
        assert planned(work, "draft_ckpt") == {"train": 1}
    finally:
        path.write_text(original)


def test_evaluation_with_tensor_parallel_workers(pipeline, tmp_path):
    """evaluate.tensor_parallel_size 2 on the CPU (two workers, each bound to a core by the
    stage): the evaluation script on the built draft, 8 prompts; its outputs go to tmp_path."""
    work, config = pipeline
    shipped = yaml.safe_load((work / "config.yaml").read_text())
    evaluate = {**shipped["evaluate"], "tensor_parallel_size": 2, "max_prompts": 8}
    params = load_config({**shipped, **config, "evaluate": evaluate}).evaluate
    results = work / "results"
    files = {
        "verifier": results / "demo" / "verifier",
        "draft": results / "train" / "draft",
        "eval_prompts": results / "demo" / "eval_prompts.jsonl",
        "metrics": results / "train" / "metrics.jsonl",
        "results": tmp_path / "results.json",
        "plot_dir": tmp_path / "plots",
    }
    args = shlex.split(cli.render("evaluate", params, files))
    proc = subprocess.run(
        [sys.executable, "-m", "workflow_scripts.stages.evaluate", *args],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(files["results"].read_text())
    assert out["num_prompts"] == 8 and out["greedy_lossless"], out["summary"]
    assert out["runs"]["eagle3"]["mean_acceptance_length"] >= 2.5, out["summary"]


def test_float8_storage_builds_to_a_draft(pipeline, tmp_path):
    """extract.storage_dtype float8_e4m3fn, on a copy of the built default (training shortened):
    the shards take about a quarter of float32's bytes, training reads them, a draft results."""
    work, config = pipeline
    copy = tmp_path / "wf"
    shutil.copytree(work, copy, symlinks=True)
    with_config(copy, config, extract={"storage_dtype": "float8_e4m3fn"}, train={"epochs": 2})
    assert planned(copy, "draft_ckpt") == {"extract": 1, "extract_merge": 1, "train": 1}
    snakemake(copy, "--cores", "2", "draft_ckpt")
    manifest = json.loads((copy / "results/extract/manifest.json").read_text())
    before = json.loads((work / "results/extract/manifest.json").read_text())
    assert manifest["storage_dtype"] == "float8_e4m3fn" and before["storage_dtype"] == "float32"
    disk = manifest["disk"]
    assert disk["by_storage_dtype"]["float32"]["bytes"] == before["bytes"]
    assert 0.25 < manifest["bytes"] / before["bytes"] < 0.3
    assert 0 < disk["final_rows"] < manifest["num_tokens"] and disk["final_rows_saved_bytes"] > 0
    assert (copy / "results/train/draft/model.safetensors").is_file()
    assert planned(copy, "draft_ckpt") == {}
