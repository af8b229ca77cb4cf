"""Outputs gone after their stage ran with other settings or code (rules/common.smk: made_from),
on a copy of the mechanics build: a stage is run alone after a change (`snakemake prepare`,
`snakemake draft_ckpt`), then its outputs are gone (a job after it killed and its files deleted
by Snakemake, a draft moved away to be served, tokenized data freed once extracted), while what
the stages after it made from the old outputs is still there. Snakemake takes a missing file
between a target and what it was made from as a removed intermediate: without made_from,
`snakemake evaluate` would find nothing to do and keep results made under the old settings.
With nothing changed, a missing intermediate still plans nothing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.test_reruns import RECORD, TARGET, downstream, other_valid_config
from tests.workflow_runner import planned_in_process, snakemake, write_config
from workflow_scripts.lib.workflow.layout import Layout

pytestmark = [pytest.mark.engine, pytest.mark.workflow]

# a stage: its outputs, the target that runs it alone, the setting changed and its entry script
STAGE = {
    "prepare": (
        [str(Layout("results").prepare.tokenized), str(Layout("results").prepare.stats)],
        "prepare",
        "max_seq_len_tokens",
        "workflow_scripts/stages/prepare.py",
    ),
    "train": (
        [str(Layout("results").train.draft), str(Layout("results").train.metrics)],
        "draft_ckpt",
        "learning_rate",
        "workflow_scripts/stages/train.py",
    ),
}


@pytest.fixture(scope="module")
def graph(mechanics_build):
    work, config = mechanics_build
    assert planned_in_process(work, TARGET, config) == {}
    return downstream(work)


def moved_away(work: Path, outputs: list[str], aside: Path) -> list[tuple[Path, Path]]:
    aside.mkdir(exist_ok=True)
    moves = [(work / rel, aside / rel.replace("/", "_")) for rel in outputs]
    for there, kept in moves:
        os.rename(there, kept)
    return moves


@pytest.mark.parametrize(
    "stage, change", [("prepare", "setting"), ("train", "setting"), ("train", "code")]
)
def test_outputs_gone_after_their_stage_changed_plan_what_they_made_again(
    mechanics_build, graph, tmp_path, stage, change
):
    work, config = mechanics_build
    copy = tmp_path / "w"
    shutil.copytree(work, copy, symlinks=True)
    outputs, target, setting, entry = STAGE[stage]

    moves = moved_away(copy, outputs, tmp_path / "aside")
    assert planned_in_process(copy, TARGET, config) == {}  # nothing changed: nothing to do
    for there, kept in moves:
        os.rename(kept, there)

    if change == "setting":
        config = other_valid_config(copy, stage, setting, config)
        write_config(copy, config)
    else:
        (copy / entry).write_text((copy / entry).read_text() + "\n_EDITED = True\n")
    proc = snakemake(copy, "--cores", "2", target)
    assert f"rule {stage}:" in proc.stderr + proc.stdout
    moved_away(copy, outputs, tmp_path / "aside2")

    plan = set(planned_in_process(copy, TARGET, config))
    # the stage again (its outputs are needed) and all it made before: evaluation, here
    assert plan == graph[stage] | ({RECORD} if change == "setting" else set()), plan
