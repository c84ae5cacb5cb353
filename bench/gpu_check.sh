#!/usr/bin/env bash
# Everything this repo checks and times on the GPU, in one device call; results under $OUT.
#   run from the repo root on the GPU machine: bash bench/gpu_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest_gpu.log"
timeout 300 python3 bench/pipeline_stress.py --device cuda:0 --chunks 10000 --guards --out "$OUT/pipeline_stress.json" 2>&1 | tail -12
timeout 420 python3 -m ringflow.cli bench ${BENCH_ARGS:-} --device cuda:0 --out "$OUT" --trace "$OUT/trace.json" --plot "$OUT/timeline.png" 2>&1 | tee "$OUT/bench.log" | tail -80
timeout 200 python3 bench/profile_host.py --device cuda:0 --out "$OUT/profile.txt" 2>&1 | head -16
