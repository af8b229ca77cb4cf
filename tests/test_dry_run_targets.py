"""The dry-run checks what the requested targets need (lib/targets.py: TARGET_STAGES;
lib/dryrun.py: requested_targets): a problem of a stage that no requested target needs is a
warning naming the targets that cannot be built, one of a stage a requested target needs an error
naming that target. Shown here with GPU counts on the embedded default (no verifier to build);
the verifier's checks, with a Gemma3 verifier vLLM serves no draft for, in test_families.py.
"""

from __future__ import annotations

import pytest

from tests.workflow_runner import (
    copy_workflow,
    dry_run_in_process,
    jobs_in,
    snakemake,
    write_config,
)
from workflow_scripts.lib import dryrun
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib import targets
from workflow_scripts.lib.workflow import checks
from workflow_scripts.lib.workflow.config import load_config
from workflow_scripts.lib.workflow.layout import Layout

# evaluation asks more GPUs than a node has; no other stage asks any
TOO_WIDE = {"gpus_per_node": 1, "evaluate": {"use_gpus": True, "tensor_parallel_size": 2}}
WHY = (
    "evaluate.tensor_parallel_size is 2 GPUs, but a node has 1 (gpus_per_node) and a job runs on "
    "one node; lower evaluate.tensor_parallel_size; draft_ckpt, hidden_states and vocab_map can"
)
WARNING = f"target evaluate (and all) cannot be built: {WHY}"


@pytest.mark.parametrize(
    "target, refused",
    [
        ("all", True),
        ("evaluate", True),
        ("evaluate_draft", True),
        (str(Layout("results").evaluate.results), True),  # a file: checked as strictly as all
        ("draft_ckpt", False),
        ("train", False),
        ("hidden_states", False),
        ("vocab_map", False),
        ("resolved_config", False),
    ],
)
def test_a_problem_of_a_stage_no_target_needs_is_a_warning(target, refused):
    cfg = load_config(TOO_WIDE)
    if refused:
        with pytest.raises(UserError) as exc:
            checks.check_gpu_counts(cfg, None, [target])
        assert str(exc.value) == f"target {target} cannot be built: {WHY}"
    else:
        assert checks.check_gpu_counts(cfg, None, [target]) == [WARNING]


def test_the_error_names_every_requested_target_that_needs_the_stage():
    with pytest.raises(UserError) as exc:
        checks.check_gpu_counts(load_config(TOO_WIDE), None, ["vocab_map", "evaluate", "all"])
    assert str(exc.value) == f"targets evaluate and all cannot be built: {WHY}"


# the stage whose settings each rule runs with, of the stages the dry-run checks one by one
RULE_STAGE = {
    "regenerate": "regenerate",
    "regenerate_merge": "regenerate",
    "extract": "extract",
    "extract_merge": "extract",
    "extract_plan": "extract",  # (a disk budget's)
    "train": "train",
    "evaluate_reference": "evaluate",
    "evaluate_draft": "evaluate",
}
# rules with wildcards are no targets a user can ask for, only cluster jobs (--target-jobs), which
# run that one job: their entries are their merges'
JOB_RULES = {
    "regenerate": "regenerate_merge",
    "extract": "extract_merge",
    "export": "export_sglang",
}
# a draft SGLang and TensorRT-LLM serve: what their export targets need (lib/draft/export.py)
SERVABLE = {"train": {"sliding_window_tokens": None, "norm_before_residual": False}}


@pytest.fixture(scope="module")
def default_workflow(tmp_path_factory):
    return copy_workflow(tmp_path_factory.mktemp("wf"))


@pytest.mark.workflow
@pytest.mark.parametrize("target", sorted(targets.TARGET_STAGES))
def test_the_stages_each_target_needs_are_those_its_dag_runs(default_workflow, target):
    """TARGET_STAGES against what Snakemake plans for each target (regeneration on, so that every
    stage is in the DAG)."""
    if target in JOB_RULES:
        assert targets.TARGET_STAGES[target] == targets.TARGET_STAGES[JOB_RULES[target]]
        return
    config = {"regenerate": {"enabled": True}, **(SERVABLE if target.startswith("export") else {})}
    error, out = dry_run_in_process(default_workflow, target, config)
    assert error is None, out[-3000:]
    planned = {RULE_STAGE[rule] for rule in jobs_in(out) if rule in RULE_STAGE}
    assert planned == targets.TARGET_STAGES[target]


@pytest.mark.workflow
def test_the_dry_run_plans_what_it_can_build_and_refuses_what_it_cannot(default_workflow):
    """Through Snakemake: draft_ckpt plans training, warning that evaluate cannot be built;
    evaluate is refused, naming the target and the key; so is the default target, all, on the
    command line, without a traceback."""
    error, out = dry_run_in_process(default_workflow, "draft_ckpt", TOO_WIDE)
    assert error is None, out[-3000:]
    assert f"Warning: {WARNING}" in out
    assert "train" in jobs_in(out) and "evaluate_draft" not in jobs_in(out)

    error, out = dry_run_in_process(default_workflow, "evaluate", TOO_WIDE)
    assert error is not None and f"target evaluate cannot be built: {WHY}" in error, out[-3000:]

    write_config(default_workflow, TOO_WIDE)
    try:
        proc = snakemake(default_workflow, "-n", check=False)
    finally:
        write_config(default_workflow, {})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"target all cannot be built: {WHY}" in out, out[-3000:]
    assert "Traceback" not in out


@pytest.mark.parametrize(
    "argv, targets",
    [
        (["/w/.venv/bin/snakemake", "-n", "prepare", "--forcerun", "vocab"], ["prepare", "vocab"]),
        (["/w/.venv/bin/snakemake", "--cores", "1", "--until", "extract"], ["extract"]),
        # a cluster job: `python -m snakemake --target-jobs ...`
        (
            ["/l/snakemake/__main__.py", "--target-jobs", "train:", "extract:job_index=0"],
            ["train", "extract"],
        ),
        (["/w/.venv/bin/snakemake", "--cores", "1"], ["all"]),  # the default target
        (["pytest", "-q"], ["all"]),  # not Snakemake's command line: every stage checked
    ],
)
def test_the_requested_targets_are_read_from_snakemakes_command_line(argv, targets):
    assert dryrun.requested_targets(argv) == targets


def check_run(tmp_path, config: dict, targets: list[str]) -> tuple[dryrun.Run, list]:
    said = []
    run = dryrun.check_run(
        load_config(config),
        targets,
        Layout(tmp_path / "results"),
        gpu_limit=None,
        profile_resources=lambda rule: {},
        default_partition=None,
        own_python=None,
        estimate=True,
        versions=None,
        say=lambda level, text: said.append((level, text)),
    )
    return run, said


def test_the_dry_runs_checks_run_without_snakemake(tmp_path):
    """lib/dryrun.py's one call, as rules/common.smk makes it: the embedded default's inputs, a
    problem of a stage no target needs said as a warning, and refused where a target needs it."""
    run, said = check_run(tmp_path, TOO_WIDE, ["draft_ckpt"])
    results = Layout(tmp_path / "results")
    assert run.verifier_dir == results.demo.verifier and run.verifier_cfg == {}
    assert run.verifier_weights == [str(results.demo.verifier / "model.safetensors")]
    assert run.data_files == [results.demo.chat_data]
    assert run.eval_files == [results.demo.eval_prompts]
    assert run.gpus == 3 and ("warning", WARNING) in said  # extract 1 (by default), evaluate 2
    with pytest.raises(UserError) as exc:
        check_run(tmp_path, TOO_WIDE, ["evaluate"])
    assert str(exc.value) == (
        f"the config asks for more GPUs than there are:\n  target evaluate cannot be built: {WHY}"
    )
