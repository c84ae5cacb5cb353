#!/usr/bin/env bash
# Everything this repo checks and times on the GPU; results under $OUT. In parts, so that each
# fits one device call (10 minutes):
#   bash bench/gpu_check.sh check   pytest -m gpu, 10k-chunk stress, 8 threads x 10k requests, demo, phases
#   bash bench/gpu_check.sh bench   ringflow bench (all workloads, trace, PNG), host profile, small arrays
#                                   through map, request host time
#   bash bench/gpu_check.sh requests  ringflow bench requests six times (RUNS=6), then the submitting
#                                   thread's stalls with and without the CPU pinning of request_stalls.py
#   bash bench/gpu_check.sh staging   the planner's staging model against the staged path on this host:
#                                   the staging measurement's splits with 2 threads, doctor --save (into
#                                   this GPU's cache, so the sweep plans with it), the path by workers,
#                                   the scheduler's own time per chunk by chunk size and workers
#   bash bench/gpu_check.sh sides     doctor --save (into this GPU's cache), then stage, register and host="auto"
#                                   against the planner (bench/sides_check.py) on 64 KiB, 1 MiB and 16 MiB arrays
#                                   at the default and the auto chunk, and on 256 MiB at 1 MiB, 8 MiB and auto;
#                                   a MapJob's choice, set-up and calls beside them
#   bash bench/gpu_check.sh rounds    ringflow against the C++ program in interleaved rounds (bench/cpp_rounds.py)
#   bash bench/gpu_check.sh warm      a warm call's time outside its engine on a registered buffer and on a pool
#                                   array (bench/stream_map_overhead.py), and three jobs in turn with a warm cache
#                                   of two and of four engines (bench/warm_capacity.py)
# $OUT gets: log.txt, pipeline_stress.json, threads.json, phases.json (check); bench-cuda-*.json, trace.json,
# timeline.png, profile.txt, map_small_items.json, request_costs.json (bench); requests_runs.json (the
# runs' JSON in one list), stalls.json, stalls_pinned.json (requests); staging_t2.json, the saved
# profile (its cache name), workers_sweep.json, scheduler_load.json (staging); the saved profile and
# sides.json (the runs' JSON in one list: sides); cpp_rounds.json (rounds); overhead.json, warm_capacity.json (warm).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
LOG="$OUT/log.txt"
part=${1:-check}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"
if [ "$part" = check ]; then
  echo "== pytest -m gpu" | tee -a "$LOG"
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -25 | tee -a "$LOG"
  echo "== pipeline stress" | tee -a "$LOG"
  timeout 200 python3 bench/pipeline_stress.py --device ${DEVICE:-cuda:0} --chunks 10000 --guards --out "$OUT/pipeline_stress.json" 2>&1 | tail -12 | tee -a "$LOG"
  echo "== threads" | tee -a "$LOG"
  timeout 200 python3 bench/threads_check.py --device ${DEVICE:-cuda:0} --threads 8 --requests 10000 --out "$OUT/threads.json" 2>&1 | grep -E '"(ok|wrong_total|errors_total|requests_per_s|live_total_after_close|wall_s)"' | tee -a "$LOG"
  echo "== demo" | tee -a "$LOG"
  ( time timeout 100 python3 -m ringflow._cli demo --out /tmp/ringflow-demo ) 2>&1 | tail -30 | tee -a "$LOG"
  echo "== phases of a seed call" | tee -a "$LOG"
  timeout 60 python3 bench/diagnose_hotpath.py --device ${DEVICE:-cuda:0} --parts phases --out "$OUT/phases.json" 2>&1 | tail -6 | cut -c1-400 | tee -a "$LOG"
elif [ "$part" = staging ]; then
  echo "== the staging measurement's splits with 2 threads, and the path with 2 workers" | tee -a "$LOG"
  timeout 90 python3 bench/staging_rate_check.py --device ${DEVICE:-cuda:0} --threads 2 --workers 2 --sizes-mib 512 --repeats 4 --rounds 2 --out "$OUT/staging_t2.json" 2>&1 | tail -5 | tee -a "$LOG"
  echo "== doctor --save" | tee -a "$LOG"
  ( time timeout 150 python3 -m ringflow doctor --save ) 2>&1 | grep -E "staging|host_copy|saved|real" | tee -a "$LOG"
  cp "$(python3 -c 'from ringflow._device.hardware import cache_dir; print(cache_dir())')"/*.json "$OUT/"
  echo "== the staged path by workers against the planner" | tee -a "$LOG"
  timeout 200 python3 bench/workers_sweep.py --device ${DEVICE:-cuda:0} --workers 1,2,4,8,16 --rounds 2 --out "$OUT/workers_sweep.json" 2>&1 | tail -11 | tee -a "$LOG"
  echo "== the scheduler's own time per staged chunk, by chunk size and workers" | tee -a "$LOG"
  timeout 150 python3 bench/scheduler_load.py --device ${DEVICE:-cuda:0} --workers 4,8,12,15,16 --chunks-kib 64,8192 --rounds 2 --out "$OUT/scheduler_load.json" 2>&1 | tee -a "$LOG"
elif [ "$part" = sides ]; then
  echo "== doctor --save" | tee -a "$LOG"
  ( time timeout 120 python3 -m ringflow doctor --save ) 2>&1 | grep -E "chunk_host|register|saved|real" | tee -a "$LOG"
  cp "$(python3 -c 'from ringflow._device.hardware import cache_dir; print(cache_dir())')"/*.json "$OUT/"
  mkdir -p "$OUT/sides"
  for mib in 0.0625 1 16; do
    echo "== stage, register and auto: $mib MiB" | tee -a "$LOG"
    timeout 90 python3 bench/sides_check.py --device ${DEVICE:-cuda:0} --mib $mib --workers 4 --chunks default,auto --rounds 10 --out "$OUT/sides/$mib.json" 2>&1 | tail -19 | tee -a "$LOG"
  done
  echo "== stage, register and auto: 256 MiB" | tee -a "$LOG"
  timeout 200 python3 bench/sides_check.py --device ${DEVICE:-cuda:0} --mib 256 --workers 4 --chunks 1024,8192,auto --rounds 3 --out "$OUT/sides/256.json" 2>&1 | tail -28 | tee -a "$LOG"
  python3 -c 'import glob, json, sys; runs = [json.load(open(p)) for p in sorted(glob.glob(sys.argv[1] + "/*.json"))]; json.dump(runs, open(sys.argv[2], "w"), indent=1)' "$OUT/sides" "$OUT/sides.json" && rm -r "$OUT/sides"
elif [ "$part" = rounds ]; then
  echo "== against the C++ program, interleaved rounds" | tee -a "$LOG"
  timeout 500 python3 bench/cpp_rounds.py --device ${DEVICE:-cuda:0} --rounds ${ROUNDS:-5} --out "$OUT/cpp_rounds.json" 2>&1 | tail -25 | tee -a "$LOG"
elif [ "$part" = warm ]; then
  echo "== a warm call outside its engine: registered buffer and pool array" | tee -a "$LOG"
  timeout 120 python3 bench/stream_map_overhead.py --device ${DEVICE:-cuda:0} --calls 2000 --memory pinned,pool --out "$OUT/overhead.json" 2>&1 | cut -c1-200 | tee -a "$LOG"
  echo "== three jobs in turn, a warm cache of two and of four engines" | tee -a "$LOG"
  timeout 200 python3 bench/warm_capacity.py --device ${DEVICE:-cuda:0} --mib 0.25,4,64 --capacities 2,4 --rounds 8 --out "$OUT/warm_capacity.json" 2>&1 | cut -c1-200 | tee -a "$LOG"
elif [ "$part" = requests ]; then
  mkdir -p "$OUT/runs"
  for i in $(seq "${RUNS:-6}"); do
    echo "== bench requests, run $i" | tee -a "$LOG"
    timeout 60 python3 -m ringflow._cli bench requests --device ${DEVICE:-cuda:0} --out "$OUT/runs" 2>&1 | tail -4 | tee -a "$LOG"
  done
  # only a few files come back from $OUT: the runs go back as one list
  python3 -c 'import glob, json, sys; runs = [json.load(open(p)) for p in sorted(glob.glob(sys.argv[1] + "/*.json"))]; json.dump(runs, open(sys.argv[2], "w"), indent=1)' "$OUT/runs" "$OUT/requests_runs.json" && rm -r "$OUT/runs"
  echo "== stalls" | tee -a "$LOG"
  timeout 150 python3 bench/request_stalls.py --device ${DEVICE:-cuda:0} --rounds 3 --out "$OUT/stalls.json" 2>&1 | grep -E "^(capacity|round)" | cut -c1-300 | tee -a "$LOG"
  echo "== stalls, submitting thread pinned" | tee -a "$LOG"
  timeout 150 python3 bench/request_stalls.py --device ${DEVICE:-cuda:0} --rounds 3 --pin --out "$OUT/stalls_pinned.json" 2>&1 | grep -E "^(pinned|capacity|round)" | cut -c1-300 | tee -a "$LOG"
else
  echo "== bench" | tee -a "$LOG"
  timeout 420 python3 -m ringflow._cli bench ${BENCH_ARGS:-} --device ${DEVICE:-cuda:0} --out "$OUT" --trace "$OUT/trace.json" --plot "$OUT/timeline.png" 2>&1 | tail -150 | tee -a "$LOG"
  timeout 100 python3 bench/profile_host.py --device ${DEVICE:-cuda:0} --out "$OUT/profile.txt" 2>&1 | head -16
  echo "== many small arrays through map: sharing chunks against each alone" | tee -a "$LOG"
  timeout 120 python3 bench/map_small_items.py --device ${DEVICE:-cuda:0} --out "$OUT/map_small_items.json" 2>&1 | tee -a "$LOG"
  echo "== request host time: staged (sharing chunks, and each alone) and pool items" | tee -a "$LOG"
  timeout 60 python3 bench/request_costs.py --device ${DEVICE:-cuda:0} --hz 0 --variants staged,staged-alone,pooled --out "$OUT/request_costs.json" 2>&1 | grep -v "progress\|submit" | cut -c1-300 | tee -a "$LOG"
fi
