#!/usr/bin/env bash
# The `requests` workload on two or more source trees, interleaved in one run on one machine:
#   bash bench/requests_ab.sh OLD_SRC NEW_SRC [ROUNDS]
#   bash bench/requests_ab.sh NAME=SRC NAME=SRC [NAME=SRC ...] [ROUNDS]
# Each round runs `ringflow bench requests` (ringflow and both torch baselines) with each tree in
# turn (new, then old; or in the order named) on PYTHONPATH (DEVICE=sim tries the script here).
# Results: $OUT/bench-requests-{NAME}N.json and a line a run in $OUT/requests-ab-log.txt (also on
# stdout).
set -o pipefail
ROUNDS=2; VARIANTS=()
if [[ "${1:-}" == *=* ]]; then
  for a in "$@"; do if [[ "$a" == *=* ]]; then VARIANTS+=("$a"); else ROUNDS=$a; fi; done
else
  OLD=${1:?old src dir}; NEW=${2:?new src dir}; ROUNDS=${3:-2}; VARIANTS=("new=$NEW" "old=$OLD")
fi
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  for pair in "${VARIANTS[@]}"; do
    v=${pair%%=*}; src=${pair#*=}
    dir=$(mktemp -d)
    PYTHONPATH=$src timeout 300 python3 -m ringflow._cli bench requests --device "${DEVICE:-cuda:0}" --out "$dir" \
      >/dev/null 2>&1 || echo "$v$i failed (rc $?)"
    mv "$dir"/bench-*.json "$OUT/bench-requests-$v$i.json"; rm -rf "$dir"
    python3 - "$OUT/bench-requests-$v$i.json" "$v$i" <<'PY' | tee -a "$OUT/requests-ab-log.txt"
import json, sys
d = json.load(open(sys.argv[1]))
r = d["workloads"]["requests"]
lv = {round(x["load"] * 100): x for x in r["levels"]}
print(sys.argv[2], "cap %.0f/s" % r["capacity_per_s"], [round(p) for p in r["capacity_passes_per_s"]],
      "vs ring %.2f naive %.2f" % (r["ringflow_vs_torch_ring"] or 0, r["ringflow_vs_torch_naive"] or 0),
      "p99@80 %.2fx (fifo %s)" % (r["p99_80_over_isolated"], [round(f, 2) for f in r["p99_80_perfect_fifo_over_isolated"]]),
      "p50@80 %.2f ms from submit %.2f" % (lv[80]["p50_ms"], lv[80]["p50_from_submit_ms"]),
      "p99@50 %.2fx p99@95 %.2fx" % (lv[50]["p99_over_isolated"], lv[95]["p99_over_isolated"]),
      "iso p50 %.2f p99 %.2f ms" % (r["isolated_p50_ms"], r["isolated_p99_ms"]), "correct", r["correct"])
PY
  done
done
