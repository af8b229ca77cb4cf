"""Run this workflow from tests: a private copy of it, real Snakemake, and what a dry-run plans."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = (
    "Snakefile",
    "rules",
    "workflow_scripts",
    "config.yaml",
    "envs",
    "profiles",
    "report",
)
# target rules: they only gather outputs, and are left out of what a plan is said to run
TARGET_RULES = {"all", "vocab_map", "hidden_states", "draft_ckpt", "evaluate"}


def copy_workflow(dst: Path, config: dict | None = None) -> Path:
    """A copy of the workflow in ``dst`` (its code can then be edited by a test), with
    ``config`` written to ``dst/test_config.yaml``."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    write_config(dst, config or {})
    return dst


def as_gpu_environment(workdir: Path) -> Path:
    """The workflow copy in ``workdir`` takes the environment that runs it for one made from the
    GPU lock, as on a GPU machine or a login node set up for one, so that it plans and runs GPU
    jobs here (its dry-run refuses them in the CPU build's: lib/verifier/environment.py)."""
    module = workdir / "workflow_scripts" / "lib" / "verifier" / "environment.py"
    module.write_text(module.read_text() + "\n\ndef cpu_build() -> None:\n    return None\n")
    return workdir


def example_workflow(root: Path, example: Path, verifier: Path) -> tuple[Path, dict]:
    """A copy of the workflow in ``root``/wf running the example config ``example`` (a
    config.*.yaml, a GPU machine's: as_gpu_environment) against ``verifier`` (a stand-in), on
    four rows of chat data that are also its evaluation prompts: (the copy, its config)."""
    chats = root / "chats.jsonl"
    row = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    }
    chats.write_text((json.dumps(row) + "\n") * 4)
    config = yaml.safe_load(example.read_text())
    config.update(verifier=str(verifier), chat_data=str(chats), eval_prompts=str(chats))
    return as_gpu_environment(copy_workflow(root / "wf", config)), config


def write_config(workdir: Path, config: dict) -> None:
    (workdir / "test_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def env() -> dict:
    """The environment of a job: `python` is this interpreter (the project's .venv)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return env


def snakemake_command(*args: str) -> list[str]:
    """This environment's Snakemake with ``args``, on the copy's test_config.yaml."""
    return [
        str(Path(sys.executable).parent / "snakemake"),
        *args,
        "--configfile",
        "test_config.yaml",
    ]


def failure(cmd: list[str], proc: subprocess.CompletedProcess) -> str:
    return (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = snakemake_command(*args)
    proc = subprocess.run(cmd, cwd=workdir, env=env(), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(failure(cmd, proc))
    return proc


def planned(workdir: Path, target: str, *args: str) -> Counter:
    """Rules a dry-run plans for ``target`` (job counts), target rules left out."""
    proc = snakemake(workdir, "-n", target, *args)
    return jobs_in(proc.stdout + proc.stderr)


def jobs_in(out: str) -> Counter:
    """The jobs of a dry-run's output, by rule (target rules left out)."""
    if "Nothing to be done" in out:
        return Counter()
    table = out.split("Job stats:", 1)[1].split("total", 1)[0]
    jobs = Counter()
    for rule, count in re.findall(r"^(\w+)\s+(\d+)\s*$", table, flags=re.M):
        if rule not in TARGET_RULES:
            jobs[rule] = int(count)
    return jobs


def dry_run_in_process(
    workdir: Path,
    target: str,
    config: dict,
    set_resources: dict | None = None,
    printshellcmds: bool = False,
    resources: dict | None = None,
    slurm: bool = False,
) -> tuple[str | None, str]:
    """A dry-run of ``target`` with ``config`` over config.yaml, from Snakemake's Python API in
    this process (a tenth of a second instead of the seconds a new Snakemake process takes):
    (the error that stopped it, or None; everything it wrote). ``set_resources``: by rule, as
    --set-resources or a profile's set-resources give them. ``printshellcmds``: as -p, each
    job's command too. ``resources``: as --resources. Its environment is taken for one made
    from the GPU lock, as as_gpu_environment does for a copy run in its own process, so that GPU
    configs plan here. ``slurm``: the dry-run asks SLURM for its nodes (sinfo), as on a cluster;
    otherwise there is none (this machine's sinfo, with no controller up outside the SLURM
    tests, would wait seconds for one to answer)."""
    import contextlib
    import io
    import tempfile
    from unittest import mock

    from workflow_scripts.lib.verifier import cluster, environment

    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        DAGSettings,
        OutputSettings,
        ResourceSettings,
        StorageSettings,
    )

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=workdir) as fh:
        fh.write(yaml.safe_dump(config, sort_keys=False))
        fh.flush()
        out = io.StringIO()
        error = None
        try:
            with (
                contextlib.redirect_stderr(out),
                contextlib.redirect_stdout(out),
                mock.patch.object(environment, "cpu_build", lambda: None),
                (
                    contextlib.nullcontext()
                    if slurm
                    else mock.patch.object(cluster, "slurm_cluster", lambda *a, **k: None)
                ),
                # the command line the checks read the targets from (lib/dryrun.py)
                mock.patch.object(sys, "argv", ["snakemake", target]),
            ):
                with SnakemakeApi(OutputSettings(printshellcmds=printshellcmds)) as api:
                    workflow = api.workflow(
                        resource_settings=ResourceSettings(
                            cores=2,
                            overwrite_resources=set_resources or {},
                            resources=resources or {},
                        ),
                        config_settings=ConfigSettings(configfiles=[Path(fh.name)]),
                        storage_settings=StorageSettings(),
                        snakefile=workdir / "Snakefile",
                        workdir=workdir,
                    )
                    dag = workflow.dag(dag_settings=DAGSettings(targets={target}))
                    dag.execute_workflow(executor="dryrun")
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    return error, out.getvalue()


def planned_in_process(workdir: Path, target: str, config: dict) -> Counter:
    """What ``planned`` returns, from ``dry_run_in_process``."""
    error, out = dry_run_in_process(workdir, target, config)
    if error is not None:
        raise AssertionError(f"dry-run failed: {error}\n{out[-6000:]}")
    return jobs_in(out)
