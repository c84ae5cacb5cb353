#!/usr/bin/env bash
# Variants of one source that differ in environment variables, interleaved in one run on one
# machine: closed-loop staged requests (bench/request_costs.py, 5 passes a run), then the
# `requests` workload (`ringflow bench requests`, its torch baselines included), each variant
# in turn, ROUNDS rounds of each:
#   bash bench/requests_env_ab.sh ROUNDS BENCH_ROUNDS NAME=VAR=VALUE[,VAR=VALUE] ...
# e.g. bash bench/requests_env_ab.sh 5 2 off=RINGFLOW_GIL_COURTESY=0 on=RINGFLOW_GIL_COURTESY=1
# Results under $OUT: rc-NAME-ROUND.json, bench-NAME-ROUND/*.json; a line a run on stdout.
set -o pipefail
ROUNDS=${1:?rounds}; BENCH_ROUNDS=${2:?bench rounds}; shift 2
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
run_env() { local spec=$1; shift; env $(echo "$spec" | tr ',' ' ') "$@"; }
for r in $(seq 1 "$ROUNDS"); do
  for v in "$@"; do
    name=${v%%=*}; spec=${v#*=}
    run_env "$spec" timeout 100 python3 bench/request_costs.py --device cuda:0 --count 1000 --hz 0 --passes 5 \
      --variants staged --no-torch --out "$OUT/rc-$name-$r.json" >/dev/null 2>&1
    python3 -c "import json; v=json.load(open('$OUT/rc-$name-$r.json'))['variants']['staged']; print('closed loop', '$name', $r, round(v['capacity_per_s']), [round(p) for p in v['passes_per_s']], 'progress', round(v['progress_cpu_us_per_request']), 'submit', round(v['submit_cpu_us_per_request']))"
  done
done
for r in $(seq 1 "$BENCH_ROUNDS"); do
  for v in "$@"; do
    name=${v%%=*}; spec=${v#*=}
    mkdir -p "$OUT/bench-$name-$r"
    run_env "$spec" timeout 150 python3 -m ringflow bench requests --device cuda:0 --out "$OUT/bench-$name-$r" >/dev/null 2>&1
    python3 - "$OUT/bench-$name-$r" "$name" "$r" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/*.json"):
    w = json.load(open(f))["workloads"]["requests"]
    print("requests", sys.argv[2], sys.argv[3], round(w["capacity_per_s"]), "vs torch ring %.2f" % w["ringflow_vs_torch_ring"],
          "p99@80 %.2fx isolated" % w["p99_80_over_isolated"], "perfect FIFO", [round(x, 2) for x in w["p99_80_perfect_fifo_over_isolated"]])
PY
  done
done
