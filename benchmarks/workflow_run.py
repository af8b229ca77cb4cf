"""The workflow as the benchmarks run it: Snakemake in a working directory of the benchmark's, over
config.yaml and the benchmark's own config files, with `python` this interpreter (the project's
.venv); the wall time of a stage, from the benchmark file its rule writes; and settings given on a
benchmark's command line (``--set KEY=VALUE``) over the config a run gets from its files
(lib/workflow/config.py: ``layered_files``)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def snakemake(
    workdir: Path,
    configfiles: list[Path],
    *args: str,
    cores: str | int = "all",
    name: str = "",
    env: dict[str, str] | None = None,
) -> float:
    """``snakemake *args`` in ``workdir`` over config.yaml and ``configfiles``; the wall seconds it
    took. A failed run ends the benchmark with the tail of its output; a run stopped mid-stage
    before is redone, not refused. ``env``: variables set besides this process's environment."""
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        *args,
        "--snakefile", str(ROOT / "Snakefile"),
        "--directory", str(workdir),
        "--cores", str(cores),
        "--rerun-incomplete",
        # config.yaml first: the Snakefile's own configfile is looked up in the working directory
        "--configfile", str(ROOT / "config.yaml"), *(str(Path(c).resolve()) for c in configfiles),
    ]  # fmt: skip
    environ = {**os.environ, **(env or {})}
    environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), environ.get("PATH", "")))
    prefix = f"[{name}] " if name else ""
    print(f"{prefix}$ {' '.join(cmd)}", flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=environ, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(
            f"{prefix}snakemake failed in {workdir}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return time.monotonic() - start


def stage_seconds(results_dir: Path, rule: str) -> float:
    """The wall time of the rule's last job, from its Snakemake benchmark file."""
    with (results_dir / "benchmarks" / f"{rule}.tsv").open() as f:
        return float(next(csv.DictReader(f, delimiter="\t"))["s"])


def settings(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` settings as a mapping, each value read as YAML (``4096``, ``true``, ``[1, 2]``)."""
    return {key: yaml.safe_load(value) for key, _, value in (i.partition("=") for i in items)}


def with_settings(raw: dict[str, Any], section: str, items: list[str]) -> dict[str, Any]:
    """``raw`` with the ``KEY=VALUE`` settings ``items`` over its ``section``."""
    return {**raw, section: {**(raw.get(section) or {}), **settings(items)}}
