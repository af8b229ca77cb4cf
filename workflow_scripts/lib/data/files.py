"""The files of a path source: a file, a directory, a glob, or a ``datasets`` ``save_to_disk``
directory, found the same way at dry-run (the rule's inputs, so that a changed file reruns what
reads it) and in the job. Light: neither datasets nor pyarrow is imported here."""

from __future__ import annotations

import glob
from pathlib import Path

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.workflow.sources import FILE_SUFFIXES

# what save_to_disk leaves in a directory (a Dataset: state.json; a DatasetDict: its splits)
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def file_kind(path: Path) -> str | None:
    """jsonl, jsonl.gz, jsonl.zst, json or parquet by the file's name; None for another file."""
    name = path.name
    for suffix in sorted(FILE_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix.lstrip(".")
    return None


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in SAVED_DATASET_MARKERS)


def source_files(path: str, key: str) -> list[Path]:
    """The files a path source reads, sorted: the file itself; every file of a known kind in a
    directory (recursively) or matching a glob; every file of a save_to_disk directory. A
    UserError naming ``key`` when there is none."""
    if set(path) & set("*?["):
        matches = sorted(Path(p) for p in glob.glob(path, recursive=True))
        files = [p for p in matches if p.is_file() and file_kind(p)]
        if not files:
            raise UserError(
                f"config key '{key}': the glob {path} matches no file of a known kind "
                f"({', '.join(FILE_SUFFIXES)})"
            )
        return files
    p = Path(path)
    if is_saved_dataset(p):
        return sorted(f for f in p.rglob("*") if f.is_file())
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and file_kind(f))
        if not files:
            raise UserError(
                f"config key '{key}': the directory {path} holds no file of a known kind "
                f"({', '.join(FILE_SUFFIXES)}) and is no datasets save_to_disk directory"
            )
        return files
    if not p.exists():
        raise UserError(f"config key '{key}': {path} does not exist")
    if file_kind(p) is None:
        raise UserError(
            f"config key '{key}': {path} is not a file of a known kind: name a "
            f"{', '.join(FILE_SUFFIXES)} file, a directory or glob of them, or a save_to_disk "
            "directory"
        )
    return [p]
