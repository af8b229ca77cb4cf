"""The code's layout: imports point one way (stage entries -> library), the light jobs import
neither torch nor vLLM, and the code inputs of each rule are the real import closure of its entry.
Read from the files (ast) and from real runs; no engine starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workflow_scripts.lib import cli
from workflow_scripts.lib.code_inputs import closure, direct_imports, module_file
from workflow_scripts.lib.definitions import VocabParams
from workflow_scripts.lib.manifest import FORMAT_VERSION
from workflow_scripts.lib.registry import STAGES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "workflow_scripts"
ENTRIES = "workflow_scripts.stages"
LIB = "workflow_scripts.lib"

# Library modules that belong to one stage (by file name); the rest are shared by several.
OWNERS = {
    "demo": ("demo_agentic", "demo_data", "demo_docs", "demo_formats", "demo_verifier"),
    "regenerate": ("regeneration", "regeneration_merge"),
    "vocab": ("vocab_map",),
    "extract": (
        "extraction",
        "disk_plan",
        "extraction_engines",
        "extraction_transformers",
        "hidden_states_connector",
    ),
    "train": (
        "trainer",
        "training_setup",
        "training_inputs",
        "training_data",
        "training_processes",
    ),
    "evaluate": ("evaluation", "evaluation_plots"),
}
OWNER_OF = {f"{LIB}.{name}": stage for stage, names in OWNERS.items() for name in names}
# Stage entries whose jobs are small CPU jobs: they must start without torch or vLLM.
LIGHT = ("extract_merge", "regenerate_merge", "vocab")
MAX_LINES = 450


def modules(package: str) -> list[str]:
    folder = ROOT.joinpath(*package.split("."))
    return sorted(f"{package}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__")


def test_every_stage_has_an_entry_script_and_every_entry_a_stage():
    assert {STAGES[s].module for s in STAGES} == set(modules(ENTRIES))


def test_library_never_imports_an_entry_script():
    upward = {(m, i) for m in modules(LIB) for i in direct_imports(m) if i.startswith(ENTRIES)}
    assert not upward, f"library modules importing stage entries: {sorted(upward)}"


def test_entry_scripts_do_not_import_each_other():
    across = {
        (m, i) for m in modules(ENTRIES) for i in direct_imports(m) if i.startswith(ENTRIES + ".")
    }
    assert not across, f"entry scripts importing other entries: {sorted(across)}"


def test_stage_library_modules_do_not_import_another_stages():
    """A library module of one stage (extraction*, training*, ...) may use the shared modules
    and its own stage's, never another stage's: the code of a stage stays where it is found."""
    assert set(OWNER_OF) <= set(modules(LIB)), set(OWNER_OF) - set(modules(LIB))
    across = set()
    for module in modules(LIB) + modules(ENTRIES):
        own = OWNER_OF.get(module) or (
            module.rsplit(".", 1)[1].removesuffix("_merge") if module.startswith(ENTRIES) else None
        )
        for imported in direct_imports(module):
            other = OWNER_OF.get(imported)
            if other is not None and other != own:
                across.add((module, imported))
    assert not across, f"imports across stages: {sorted(across)}"


def test_no_file_is_longer_than_a_reader_holds():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


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
            "stats": tmp / "stats.json",
        }
    if stage == "extract_merge":
        (tmp / "shard_000000.safetensors").write_bytes(b"0123")
        part = {
            "format_version": FORMAT_VERSION, "num_jobs": 1, "num_shards": 1, "kind": "extract_part",
            "job_index": 0, "shard_indices": [0], "num_samples": 1, "num_tokens": 4,
            "num_skipped_too_long": 0, "skipped_too_long": [],
            "shards": [{"index": 0, "file": "shard_000000.safetensors", "bytes": 4,
                        "num_samples": 1, "num_tokens": 4}],
        }  # fmt: skip
        (tmp / "part_0.json").write_text(json.dumps(part))
        return {"parts": [tmp / "part_0.json"], "manifest": tmp / "manifest.json"}
    assert stage == "regenerate_merge"
    (tmp / "batches").mkdir()
    row = {"id": "r", "messages": [{"role": "user", "content": "q"}]}
    batch = {"fingerprint": "f", "rows": [row], "stats": {"rows_out": 1}, "bad": {}}
    (tmp / "batches" / "batch-000000.json").write_text(json.dumps(batch))
    part = {
        "fingerprint": "f", "chat_data": "c", "verifier": "v", "num_jobs": 1, "job_index": 0,
        "num_batches": 1, "batches": [0], "batches_reused": 0, "rows_in": 1, "bad_rows": {},
        "seconds": 0.0, "params": {},
    }  # fmt: skip
    (tmp / "part_0.json").write_text(json.dumps(part))
    return {
        "parts": [tmp / "part_0.json"],
        "work_dir": tmp / "batches",
        "regenerated": tmp / "chat.jsonl",
        "stats": tmp / "stats.json",
    }


@pytest.mark.parametrize("stage", LIGHT)
def test_light_jobs_import_neither_torch_nor_vllm(stage, tmp_path):
    """The whole job, run for real on small inputs: torch and vLLM are never loaded."""
    files = light_job_inputs(stage, tmp_path)
    params = VocabParams(draft_vocab_size=10) if stage == "vocab" else None
    argv = cli.render(stage, params, files)
    code = (
        "import runpy, shlex\n"
        f"sys.argv = ['{stage}'] + shlex.split({argv!r})\n"
        f"runpy.run_module('{STAGES[stage].module}', run_name='__main__')"
    )
    loaded = loaded_modules(code)
    outputs = {"vocab": "vocab_map", "extract_merge": "manifest", "regenerate_merge": "regenerated"}
    assert files[outputs[stage]].is_file()  # the job ran to its end
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "vllm", "transformers")}
    assert not heavy, sorted(heavy)[:10]
