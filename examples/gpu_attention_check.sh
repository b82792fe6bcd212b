#!/usr/bin/env bash
# One-shot GPU check of the split tree attention (bf16 exactness, then the benchmark).
# Run from the repository root on a CUDA machine; flash-attn is used when it imports, never required.
# Results (gpu_check.json, attention_bench.json, attention_bench_window.json, log.txt) go to $OUT
# when it is set, else runs/gpu_check. Takes a few minutes on an H200; exits non-zero if a check fails.
set -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
PYTHON="${PYTHON:-python3}"
PYTHONUNBUFFERED=1 "$PYTHON" -m ddtree.bench.gpu_check --out "$out" "$@" 2>&1 | tee "$out/log.txt"
