#!/usr/bin/env bash
# The staging copy called holding the GIL (ctypes.PyDLL) for copies up to a size, against the
# ctypes call that lets go of it, interleaved in one run on one machine: closed-loop staged
# requests (bench/request_costs.py, 5 passes a run), each variant in turn, ROUNDS rounds.
#   bash bench/copy_hold_gil_ab.sh [ROUNDS]
# Needs the source of the commit that added this script, whose native copy has the knob
# RINGFLOW_COPY_HOLD_GIL_BYTES (later taken out). Results: $OUT/rc-VARIANT-ROUND.json; a line a run on stdout.
set -o pipefail
ROUNDS=${1:-4}
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
for r in $(seq 1 "$ROUNDS"); do
  for v in 0:0 256k:262144 1m:1048576 all:1073741824; do
    name=${v%%:*}; bytes=${v#*:}
    RINGFLOW_COPY_HOLD_GIL_BYTES=$bytes timeout 100 python3 bench/request_costs.py --device cuda:0 --count 1000 \
      --hz 0 --passes 5 --variants staged --no-torch --out "$OUT/rc-$name-$r.json" >/dev/null 2>&1
    python3 -c "import json; v=json.load(open('$OUT/rc-$name-$r.json'))['variants']['staged']; print('$name', $r, round(v['capacity_per_s']), [round(p) for p in v['passes_per_s']], 'progress', round(v['progress_cpu_us_per_request']), 'submit', round(v['submit_cpu_us_per_request']))"
  done
done
