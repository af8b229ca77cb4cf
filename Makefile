# The two commands of README.md: `make demo` (build the embedded default end to end) and
# `make test`. Both create .venv and install the pinned CPU requirements first.
VENV ?= .venv
PY := $(VENV)/bin/python
CORES ?= all
TARGET ?= draft_ckpt
# Rules call `python`: the one in .venv.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: venv demo test lint format lock clean

venv: $(VENV)/.installed

$(VENV)/.installed: envs/requirements-cpu.lock
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# --no-deps: the lock is the complete, tested set (it leaves out PyPI's torchvision,
	# torchaudio and torchcodec, which are built for CUDA torch and break imports beside +cpu torch)
	$(PY) -m pip install --quiet --no-deps -r envs/requirements-cpu.lock
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

# Re-resolve envs/requirements-cpu.txt into the lock (needs the package registry).
lock:
	rm -rf .venv-lock && python3 -m venv .venv-lock
	.venv-lock/bin/pip install --quiet -r envs/requirements-cpu.txt
	.venv-lock/bin/pip uninstall --yes torchvision torchaudio torchcodec
	.venv-lock/bin/pip freeze > envs/requirements-cpu.lock
	rm -rf .venv-lock

clean:
	rm -rf results .snakemake
