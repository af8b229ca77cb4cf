#!/usr/bin/env bash
# The GPU set-up, checked on any Linux x86-64 machine (no GPU needed; not in the suite: it
# downloads several GB): `make venv GPU=1` installs envs/requirements-gpu.lock into a scratch
# environment, which then runs `snakemake -n -p` of config.gpu-8x.yaml against a stand-in of its
# 70B verifier (config, tokenizer and weight index; no weights; tests/test_envs.py: llama_70b).
#
#   bash benchmarks/check_gpu_install.sh [SCRATCH_DIR]    # default: a new directory under /tmp
#
# pip runs as on a GPU machine: without this machine's pip configuration (which may offer local
# torch wheels built for the CPU, or cap torch's version) and without a cache (the GPU lock's
# wheels take about as much disk again).
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(realpath "${1:-$(mktemp -d /tmp/check_gpu_install.XXXXXX)}")
venv=$scratch/venv-gpu
mkdir -p "$scratch"
echo "scratch: $scratch; free disk: $(df -h --output=avail "$scratch" | tail -1)"

start=$SECONDS
env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL \
    PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1 make venv GPU=1 VENV="$venv"
echo "make venv GPU=1: $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"

"$venv/bin/python" - <<'EOF'
"""What was installed, against the lock: every package at its locked version, torch CUDA's."""
import importlib.metadata as md
import re

import torch
from packaging.requirements import Requirement

canonical = lambda name: re.sub(r"[-_.]+", "-", name).lower()
locked = {}
for line in open("envs/requirements-gpu.lock"):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    req = Requirement(line)  # a line with a marker for another Python is not this one's
    if req.marker is None or req.marker.evaluate():
        locked[canonical(req.name)] = str(req.specifier).removeprefix("==")
installed = {canonical(d.metadata["Name"]): d.version for d in md.distributions()}
differ = {n: (v, installed.get(n)) for n, v in locked.items() if installed.get(n) != v}
print(f"installed: {len(installed)} packages; locked ones at another version: {differ or 'none'}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {md.version('vllm')}")
assert not differ and torch.version.cuda and "+cpu" not in torch.__version__
EOF

"$venv/bin/python" - "$scratch" <<'EOF'
"""A copy of the workflow with config.gpu-8x.yaml against the stand-in (test_config.yaml)."""
import sys
from pathlib import Path

from tests.test_envs import gpu_example

work, _ = gpu_example(Path(sys.argv[1]))
print(f"workflow copy: {work}")
EOF

cd "$scratch/wf"
start=$SECONDS
set +e
PATH=$venv/bin:$PATH timeout 900 "$venv/bin/snakemake" -n -p evaluate --resources gpu=8 \
    --configfile test_config.yaml > dry-run.log 2>&1
status=$?
set -e
echo "snakemake -n -p evaluate --configfile config.gpu-8x.yaml (stand-in verifier): exit $status," \
    "$((SECONDS - start)) s; its output: $scratch/wf/dry-run.log"
sed -n '/^Job stats:/,/^$/{p;/^$/q}' dry-run.log  # the first of its two tables
echo "the engine commands it renders:"
grep -E -- "-m workflow_scripts\.stages\.(regenerate|extract|evaluate) " dry-run.log \
    | grep -oE -- "--(kv-cache-memory-bytes|enforce-eager|dtype|gpu-memory-utilization|tensor-parallel-size) [^ ]+" \
    | sort | uniq -c
[ "$status" = 0 ] || { tail -40 dry-run.log; exit "$status"; }
