"""The code a stage runs: the project's modules in the import closure of its entry script.

Rules list these files as inputs, so that an edit to any module a stage imports (at the top of a
module or inside a function) reruns that stage and nothing else. Found by reading the imports
(``ast``), not by importing: the dry-run stays fast and needs neither torch nor vLLM.

    # prints the files of the train stage's code
    python -m workflow_scripts.lib.workflow.code_inputs workflow_scripts.stages.train
"""

from __future__ import annotations

import ast
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


if __name__ == "__main__":
    for file in closure_files(sys.argv[1]):
        print(file.relative_to(ROOT))
