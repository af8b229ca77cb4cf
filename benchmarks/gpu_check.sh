#!/usr/bin/env bash
# The GPU paths, on one GPU, within 8 minutes: a few training steps of a draft shaped like a large
# verifier's (hidden 4096, 32 heads, 8 key/value heads, draft vocabulary 32k) on samples of 8192
# tokens with 7 TTT steps, in bf16 autocast, under torchrun with NCCL (one process: DDP, the
# pinned-memory loader thread); it prints peak GPU memory, tokens/s and the loss falling. Then
# the training-step benchmark on the GPU, as far as the time allows.
#
#   benchmarks/gpu_check.sh [OUT_DIR]         # on a GPU machine (torch, safetensors, transformers)
#   GPU_CHECK_SMALL=1 benchmarks/gpu_check.sh # the same steps at small sizes, on a CPU
#
# Python packages missing there (pydantic) may travel as wheels in .whl/ (installed to /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/gpu_check}}"
WORK="$(mktemp -d)"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
SMALL=()
BENCH=(--device cuda --dtype bfloat16 --tokens 2048 4096 8192 --steps 1 7)
if [ -n "${GPU_CHECK_SMALL:-}" ]; then
    SMALL=(--small)
    BENCH=(--tokens 256 512 --steps 1 3 --draft-vocab 2048)
fi

"$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
"$PY" benchmarks/gpu_check.py fp8 "${SMALL[@]}" | tee "$OUT/fp8.txt"
start=$(date +%s)
"$PY" benchmarks/gpu_check.py prepare "$WORK" "${SMALL[@]}"
read -r -a ARGS <<<"$("$PY" benchmarks/gpu_check.py args "$WORK" "${SMALL[@]}")"
timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node=1 \
    -m workflow_scripts.stages.train "${ARGS[@]}" 2>&1 | tee "$OUT/train.log"
"$PY" benchmarks/gpu_check.py report "$OUT/train.log" | tee "$OUT/report.txt"
echo "training check: $(( $(date +%s) - start )) s"

left=$(( 420 - ($(date +%s) - start) ))
if [ "$left" -gt 30 ]; then
    timeout "$left" "$PY" benchmarks/bench_train_memory.py "${BENCH[@]}" 2>&1 \
        | tee "$OUT/bench_train_memory.txt" || echo "benchmark stopped at the time limit"
fi
rm -rf "$WORK"
