#!/usr/bin/env bash
# Everything this repo checks and times on the GPU, in one device call; results under $OUT.
#   run from the repo root on the GPU machine: bash bench/gpu_check.sh
# $OUT gets: log.txt (GPU, pytest -m gpu, demo), pipeline_stress.json, bench-cuda-*.json,
# trace.json + timeline.png (a profiled run), profile.txt (host-side costs).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
LOG="$OUT/log.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$LOG"
echo "== pytest -m gpu" | tee -a "$LOG"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -25 | tee -a "$LOG"
echo "== pipeline stress" | tee -a "$LOG"
timeout 300 python3 bench/pipeline_stress.py --device cuda:0 --chunks 10000 --guards --out "$OUT/pipeline_stress.json" 2>&1 | tail -12
echo "== demo" | tee -a "$LOG"
( time timeout 120 python3 -m ringflow.cli demo --out /tmp/ringflow-demo ) 2>&1 | tail -30 | tee -a "$LOG"
echo "== bench" | tee -a "$LOG"
timeout 420 python3 -m ringflow.cli bench ${BENCH_ARGS:-} --device cuda:0 --out "$OUT" --trace "$OUT/trace.json" --plot "$OUT/timeline.png" 2>&1 | tail -150
timeout 200 python3 bench/profile_host.py --device cuda:0 --out "$OUT/profile.txt" 2>&1 | head -16
