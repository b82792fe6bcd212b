#!/usr/bin/env bash
# One-shot GPU check: the exactness tests (pytest -m gpu tests/test_gpu.py), then the benchmarks.
# Run from the repository root on a CUDA machine; flash-attn is used when it imports, never required.
# Results (gpu_tests.xml, exactness/, gpu_check.json, attention_bench*.json, linear_bench.json, log.txt) go to $OUT
# when it is set, else runs/gpu_check. Takes a few minutes on an H200; exits non-zero if a check fails.
set -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
PYTHON="${PYTHON:-python3}"
PYTHONUNBUFFERED=1 "$PYTHON" -m ddtree.bench.gpu_check --out "$out" "$@" 2>&1 | tee "$out/log.txt"
