#!/usr/bin/env bash
# Whether a request stream's capacity is a property of the process: ROUNDS processes a variant
# (variants interleaved) each measure closed-loop staged requests (bench/request_costs.py, 5
# passes), with every thread's CPU sampled twice a second while it runs (ps -L), and the host's
# CPU topology saved once:
#   bash bench/requests_modes.sh ROUNDS NAME=VAR=VALUE[,VAR=VALUE] ...
# e.g. bash bench/requests_modes.sh 6 default=RINGFLOW_NATIVE_COPY=1 nospin=RINGFLOW_COPY_SPIN_US=0
# Results under $OUT: topology.txt, rc-NAME-ROUND.json, ps-NAME-ROUND.txt; a line a run on stdout.
set -o pipefail
ROUNDS=${1:?rounds}; shift
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
{ nproc; lscpu; for c in /sys/devices/system/cpu/cpu[0-9]*; do
    echo "${c##*/} core $(cat "$c/topology/core_id" 2>/dev/null) package $(cat "$c/topology/physical_package_id" 2>/dev/null) siblings $(cat "$c/topology/thread_siblings_list" 2>/dev/null)"
  done; cat /sys/fs/cgroup/cpu.max 2>/dev/null; } > "$OUT/topology.txt" 2>&1
run_env() { local spec=$1; shift; env $(echo "$spec" | tr ',' ' ') "$@"; }
for r in $(seq 1 "$ROUNDS"); do
  for v in "$@"; do
    name=${v%%=*}; spec=${v#*=}
    run_env "$spec" timeout 100 python3 bench/request_costs.py --device cuda:0 --count 1000 --hz 0 --passes 5 \
      --variants staged --no-torch --out "$OUT/rc-$name-$r.json" >/dev/null 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
      child=$(pgrep -n -x python3)  # the run (under env and timeout): the newest python3
      [ -n "$child" ] && { date +%s.%N; ps -L -o tid=,psr=,pcpu=,stat= -p "$child"; } >> "$OUT/ps-$name-$r.txt" 2>/dev/null
      sleep 0.5
    done
    wait "$pid" || echo "$name $r failed (rc $?)"
    python3 - "$OUT/rc-$name-$r.json" "$name" "$r" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))["variants"]["staged"]
print(sys.argv[2], sys.argv[3], "capacity", round(v["capacity_per_s"]), [round(p) for p in v["passes_per_s"]],
      "cpu us a request: progress", round(v["progress_cpu_us_per_request"]), "submit", round(v["submit_cpu_us_per_request"]))
PY
  done
done
