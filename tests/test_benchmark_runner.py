"""benchmarks/workflow_run.py: the config a benchmark's run gets and the stage times it reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workflow_run import settings, snakemake, stage_seconds, with_settings  # noqa: E402
from workflow_scripts.lib.workflow.config import layered_files  # noqa: E402


def test_config_files_layer_as_snakemake_layers_them_and_settings_go_over_a_section(tmp_path):
    base, over, empty = tmp_path / "base.yaml", tmp_path / "over.yaml", tmp_path / "empty.yaml"
    base.write_text("results_dir: r\ntrain: {epochs: 2, learning_rate: 0.001}\nvocab: {a: 1}\n")
    over.write_text("train: {epochs: 3}\nvocab: null\n")
    empty.write_text("")
    raw = layered_files([base, empty, over])
    assert raw == {
        "results_dir": "r",
        "train": {"epochs": 3, "learning_rate": 0.001},
        "vocab": None,
    }
    assert settings(["epochs=4", "ids=[1, 2]", "on=true", "name=a=b"]) == {
        "epochs": 4,
        "ids": [1, 2],
        "on": True,
        "name": "a=b",
    }
    got = with_settings(raw, "train", ["epochs=5"])
    assert got["train"] == {"epochs": 5, "learning_rate": 0.001}
    assert raw["train"]["epochs"] == 3  # the files' data is left as it was
    assert with_settings(raw, "vocab", ["a=2"])["vocab"] == {"a": 2}  # a section set to null
    # the project's own files: the real-model benchmark's results_dir over config.yaml's
    assert layered_files([ROOT / "config.yaml", ROOT / "config.real.yaml"])["results_dir"] == (
        "results-real"
    )


def test_stage_seconds_reads_the_rules_benchmark_file(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "train.tsv").write_text(
        "s\th:m:s\tmax_rss\n928.08\t0:15:28\t6342.29\n"
    )
    assert stage_seconds(tmp_path, "train") == 928.08


@pytest.mark.slow  # a Snakemake process: the workflow parsed, 15 to 60 s here
def test_a_failed_snakemake_run_ends_the_benchmark_with_its_output(tmp_path):
    """The workflow parsed (the Snakefile and config.yaml found from any working directory) and
    the target refused: its output tail is the benchmark's last word."""
    with pytest.raises(SystemExit, match=r"(?s)\[check\] snakemake failed in .*no_such_rule"):
        snakemake(tmp_path / "work", [], "no_such_rule", cores=1, name="check")
