"""The code's layout: the library in packages by concept, imports pointing one way (stage entries
-> the library's packages, layer by layer down to the plumbing) with no circle between modules or
packages, the light jobs importing neither torch nor vLLM, and the code inputs of each rule the
real import closure of its entry. Read from the files (ast) and from real runs; no engine starts."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import factories
from workflow_scripts.lib.hidden_states.records import ShardEntry
from workflow_scripts.lib.regeneration.records import AnswerBatch, AnswerCounts, RegeneratePart
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.code_inputs import closure, direct_imports, module_file
from workflow_scripts.lib.workflow.definitions import DataParams, VocabParams
from workflow_scripts.lib.workflow import layout
from workflow_scripts.lib.workflow.layout import MANIFEST, STATS
from workflow_scripts.lib.workflow.registry import STAGES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "workflow_scripts"
ENTRIES = "workflow_scripts.stages"
LIB = "workflow_scripts.lib"

# The library's packages (and its few top-level modules), bottom layer first, as ARCHITECTURE.md
# draws them. A module imports from its own package or from a lower layer, never sideways or up.
LAYERS = (
    ("common", "targets"),
    ("workflow", "verifier", "draft"),
    ("data", "hidden_states"),
    ("chat",),
    ("demo", "regeneration", "training", "evaluation"),
    ("dryrun",),
)
# What the rules import of the library: the dry-run's one call, the settings, paths and commands,
# and the user's errors.
RULES_IMPORT = ("common", "dryrun", "workflow")
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
# Packages of the top layer that belong to one stage: no other stage's entry imports them.
STAGE_PACKAGES = {
    "demo": "demo",
    "regenerate": "regeneration",
    "train": "training",
    "evaluate": "evaluation",
}
MAX_TOP_LEVEL_MODULES = 3
# Stage entries whose jobs are small CPU jobs: they must start without torch or vLLM.
LIGHT = ("data", "extract_merge", "regenerate_merge", "vocab")
MAX_LINES = 450


def modules(package: str) -> list[str]:
    """The modules directly in ``package`` (not in its subpackages)."""
    folder = ROOT.joinpath(*package.split("."))
    return sorted(f"{package}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__")


def library_modules() -> list[str]:
    """Every module and package under lib/ (a package by its ``__init__``), lib itself left out."""
    found = []
    for path in (ROOT / "workflow_scripts" / "lib").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != LIB:
            found.append(name)
    return sorted(found)


def part_of(module: str) -> str | None:
    """The library package (or top-level module) ``module`` belongs to; None outside lib/."""
    if not module.startswith(LIB + "."):
        return None
    return module[len(LIB) + 1 :].split(".")[0]


def import_graph() -> dict[str, set[str]]:
    """Library module -> the library modules it imports (anywhere in its file)."""
    return {m: {i for i in direct_imports(m) if part_of(i) is not None} for m in library_modules()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, or with a self-loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"], ["e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_stage_has_an_entry_script_and_every_entry_a_stage():
    assert {STAGES[s].module for s in STAGES} == set(modules(ENTRIES))


def test_the_library_is_packages_by_concept():
    """lib/ holds the packages of LAYERS and a handful of modules at most; every package and
    top-level module is in a layer, and every layer's name is there."""
    top = {p.stem for p in (ROOT / "workflow_scripts" / "lib").glob("*.py")} - {"__init__"}
    packages = {
        p.name
        for p in (ROOT / "workflow_scripts" / "lib").iterdir()
        if (p / "__init__.py").is_file()
    }
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)
    assert top | packages == set(LAYER_OF), (top | packages) ^ set(LAYER_OF)


def test_library_never_imports_an_entry_script():
    upward = {(m, i) for m in library_modules() for i in direct_imports(m) if i.startswith(ENTRIES)}
    assert not upward, f"library modules importing stage entries: {sorted(upward)}"


def test_entry_scripts_do_not_import_each_other():
    across = {
        (m, i) for m in modules(ENTRIES) for i in direct_imports(m) if i.startswith(ENTRIES + ".")
    }
    assert not across, f"entry scripts importing other entries: {sorted(across)}"


def test_library_imports_point_down_the_layers():
    """A module imports from its own package or from a lower layer: never sideways (demo from
    training) and never up (the plumbing from a stage's package)."""
    wrong = set()
    for module, imported in import_graph().items():
        here = part_of(module)
        for target in imported:
            there = part_of(target)
            if there != here and LAYER_OF[there] >= LAYER_OF[here]:
                wrong.add((module, target))
    assert not wrong, f"imports sideways or up the layers: {sorted(wrong)}"


def test_no_module_or_package_imports_one_that_imports_it_back():
    graph = import_graph()
    assert circles(graph) == [], "modules importing each other"
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        here = part_of(module)
        packages.setdefault(here, set()).update(part_of(i) for i in imported if part_of(i) != here)
    assert circles(packages) == [], "packages importing each other"


def test_a_stage_package_is_imported_by_its_own_entry_only():
    across = set()
    for stage in STAGES:
        # a stage's package is its config section's (evaluate_reference: evaluation)
        own = STAGE_PACKAGES.get(STAGES[stage].config_key or stage.removesuffix("_merge"))
        for imported in direct_imports(STAGES[stage].module):
            package = part_of(imported)
            if package in STAGE_PACKAGES.values() and package != own:
                across.add((stage, imported))
    assert not across, f"entries importing another stage's package: {sorted(across)}"


def test_no_file_is_longer_than_a_reader_holds():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


RECORD_NAMES = (layout.MANIFEST, layout.RESULTS, layout.STATS, layout.METRICS, layout.STREAM_PLAN)


def code_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string in a module's code, docstrings and settings' texts left out."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(getattr(node, "body", None), list)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    docs |= {  # the texts of settings
        id(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
        for k in node.keywords if k.arg == "description"
    }  # fmt: skip
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_only_the_layout_names_the_files_stages_hand_each_other():
    """manifest.json, results.json, stats.json, metrics.jsonl and stream_plan.json are named in
    lib/workflow/layout.py alone: the rules, the library, the benchmarks and the tests take them
    (and every path under results_dir) from it."""
    found = []
    for path in sorted([*ROOT.glob("workflow_scripts/**/*.py"), *ROOT.glob("benchmarks/*.py")]):
        found += [(path, n, t) for n, t in code_strings(path) if any(r in t for r in RECORD_NAMES)]
    for path in sorted(ROOT.glob("tests/*.py")):
        found += [(path, n, t) for n, t in code_strings(path) if any(r in t for r in RECORD_NAMES)]
    for path in [ROOT / "Snakefile", *sorted(ROOT.glob("rules/*.smk"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            found += [(path, n, code) for r in RECORD_NAMES if r in code]
    found = [(p.relative_to(ROOT), n, t) for p, n, t in found if p != ROOT / layout.__file__]
    assert [f for f in found if f[0] != Path("workflow_scripts/lib/workflow/layout.py")] == []


def test_the_rules_import_only_the_dry_run_and_the_workflow_contract():
    """rules/*.smk take the checks from lib/dryrun.py (one call) and the settings, paths and
    commands from lib/workflow/: a check is tested without Snakemake, in the library."""
    found = {}
    for path in [ROOT / "Snakefile", *sorted(ROOT.glob("rules/*.smk"))]:
        for line in path.read_text().splitlines():
            words = line.split()
            if len(words) > 1 and words[0] in ("from", "import") and words[1].startswith(LIB):
                module = f"{LIB}.{words[3]}" if words[1] == LIB else words[1]  # from lib import x
                found[module] = path.name
    assert found and all(part_of(m) in RULES_IMPORT for m in found), found


def test_closure_finds_imports_of_every_form(tmp_path):
    pkg = tmp_path / "workflow_scripts"
    (pkg / "lib").mkdir(parents=True)
    for name in ("__init__", "lib/__init__", "lib/a", "lib/b", "lib/c", "lib/d"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "lib" / "a.py").write_text(
        "from workflow_scripts.lib import b\n"
        "def f():\n    from . import c\n"  # relative, inside a function
    )
    (pkg / "lib" / "c.py").write_text("import workflow_scripts.lib.d as d\nimport json\n")
    assert closure("workflow_scripts.lib.a", tmp_path) == (
        "workflow_scripts",
        "workflow_scripts.lib",
        "workflow_scripts.lib.a",
        "workflow_scripts.lib.b",
        "workflow_scripts.lib.c",
        "workflow_scripts.lib.d",
    )


def loaded_modules(code: str) -> set[str]:
    """Runs ``code`` in a fresh interpreter; returns what it left in sys.modules."""
    probe = "import json, sys\n" f"{code}\n" "print(json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.parametrize("stage", list(STAGES))
def test_closure_holds_every_module_an_entry_imports(stage):
    """What Python really loads when the entry starts is in the closure the rules list."""
    module = STAGES[stage].module
    loaded = loaded_modules(f"import {module}")
    ours = {m for m in loaded if m == "workflow_scripts" or m.startswith("workflow_scripts.")}
    assert ours <= set(closure(module)), ours - set(closure(module))
    assert all(module_file(m) for m in closure(module))


def light_job_inputs(stage: str, tmp: Path) -> dict:
    """Small but real inputs for a light job's entry script; its files by IO field name."""
    if stage == "vocab":
        (tmp / "verifier").mkdir()
        (tmp / "verifier" / "config.json").write_text(
            json.dumps({"hidden_size": 8, "num_hidden_layers": 4, "vocab_size": 50})
        )
        row = {"id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}
        (tmp / "t.jsonl").write_text(json.dumps(row) + "\n")
        return {
            "tokenized": tmp / "t.jsonl",
            "verifier": tmp / "verifier",
            "vocab_map": tmp / "vocab_map.safetensors",
            "stats": tmp / STATS,
        }
    if stage == "data":
        row = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}
        (tmp / "chats.jsonl").write_text(json.dumps(row) + "\n")
        return {"mixture": tmp / "chat_data.jsonl", "stats": tmp / STATS}
    if stage == "extract_merge":
        (tmp / "shard_000000.safetensors").write_bytes(b"0123")
        shard = ShardEntry(
            file="shard_000000.safetensors", sample_start=0, num_samples=1, num_tokens=4,
            num_loss_tokens=3, bytes=4, sha256="0" * 64, index=0, sample_end=1, num_skipped=0,
            fingerprint="f",
        )  # fmt: skip
        factories.part(shards=[shard]).write(tmp / "part_0.json")
        return {"parts": [tmp / "part_0.json"], "manifest": tmp / MANIFEST}
    assert stage == "regenerate_merge"
    (tmp / "batches").mkdir()
    row = {"id": "r", "messages": [{"role": "user", "content": "q"}]}
    AnswerBatch(fingerprint="f", rows=[row], stats=AnswerCounts(rows_out=1), bad={}).write(
        tmp / "batches" / "batch-000000.json"
    )
    RegeneratePart(
        input_sha256="i", batch_keys=["f"], chat_data="c", verifier="v", num_jobs=1, job_index=0,
        num_batches=1,
        batches=[0], batches_reused=0, rows_in=1, bad_rows={}, seconds=0.0, params={},
        made_by=factories.HEADER["made_by"],
    ).write(tmp / "part_0.json")  # fmt: skip
    return {
        "parts": [tmp / "part_0.json"],
        "work_dir": tmp / "batches",
        "regenerated": tmp / "chat.jsonl",
        "stats": tmp / STATS,
    }


@pytest.mark.parametrize("stage", LIGHT)
def test_light_jobs_import_neither_torch_nor_vllm(stage, tmp_path):
    """The whole job, run for real on small inputs: torch and vLLM are never loaded."""
    files = light_job_inputs(stage, tmp_path)
    params = {
        "vocab": VocabParams(draft_vocab_size=10),
        "data": DataParams(chat_data=str(tmp_path / "chats.jsonl")),
    }.get(stage)
    argv = cli.render(stage, params, files)
    code = (
        "import runpy, shlex\n"
        f"sys.argv = ['{stage}'] + shlex.split({argv!r})\n"
        f"runpy.run_module('{STAGES[stage].module}', run_name='__main__')"
    )
    loaded = loaded_modules(code)
    outputs = {
        "vocab": "vocab_map",
        "data": "mixture",
        "extract_merge": "manifest",
        "regenerate_merge": "regenerated",
    }
    assert files[outputs[stage]].is_file()  # the job ran to its end
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "vllm", "transformers")}
    assert not heavy, sorted(heavy)[:10]


def test_each_package_names_its_modules():
    """A package's docstring says what each of its modules holds: a new module is named there."""
    for init in sorted((ROOT / "workflow_scripts" / "lib").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__")
        unnamed = [m for m in modules if f"``{m}``" not in doc]
        assert not unnamed, f"{init.relative_to(ROOT)} does not name {unnamed}"


def test_entry_scripts_are_thin():
    """An entry script parses its arguments, calls the library and writes what it returns: its
    main is short, and it defines nothing a test would want to call but main (and train's split
    of the GPUs between training and the engine within a disk budget)."""
    for path in sorted((ROOT / "workflow_scripts" / "stages").glob("[!_]*.py")):
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert set(functions) - {"split_gpus"} == {"main"}, path.name
        main = functions["main"]
        assert (
            main.end_lineno - main.lineno < 40
        ), f"{path.name}: main is {main.end_lineno - main.lineno + 1} lines"
