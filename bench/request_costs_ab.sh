#!/usr/bin/env bash
# A/B of two source trees on the request path, interleaved in one run on one machine:
#   [VARIANTS=staged,pooled] bash bench/request_costs_ab.sh OLD_SRC NEW_SRC [ROUNDS]
# Each round runs bench/request_costs.py (closed loop, the VARIANTS given, default staged requests,
# CPU time per thread) with
# OLD_SRC, then NEW_SRC, on PYTHONPATH; the torch ring runs in the first and the last round of
# each. Results: $OUT/request-costs-ab.json (every run's JSON by version and round); a line a run
# on stdout.
set -o pipefail
OLD=${1:?old src dir}; NEW=${2:?new src dir}; ROUNDS=${3:-3}
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
RUNS=$(mktemp -d)
for i in $(seq 1 "$ROUNDS"); do
  for v in old new; do
    src=$OLD; [ "$v" = new ] && src=$NEW
    torch=--no-torch; { [ "$i" = 1 ] || [ "$i" = "$ROUNDS" ]; } && torch=
    PYTHONPATH=$src timeout 120 python3 bench/request_costs.py --device cuda:0 --count 1000 --passes 3 --hz 0 \
      --variants "${VARIANTS:-staged}" $torch --out "$RUNS/rc-$v-$i.json" >/dev/null 2>&1
    python3 - "$RUNS/rc-$v-$i.json" "$v" "$i" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); ring = d.get("torch_ring") or {}
for name, v in d["variants"].items():
    print(sys.argv[2], sys.argv[3], name, "capacity %.0f/s" % v["capacity_per_s"], "passes", [round(p) for p in v["passes_per_s"]],
          "progress %.0f us, submit %.0f us a request" % (v["progress_cpu_us_per_request"], v["submit_cpu_us_per_request"]),
          "torch ring %.0f/s" % ring["capacity_per_s"] if ring.get("capacity_per_s") else "")
PY
  done
done
python3 - "$RUNS" "$OUT/request-costs-ab.json" "$OLD" "$NEW" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(p)[3:-5]: json.load(open(p)) for p in sorted(glob.glob(os.path.join(sys.argv[1], "rc-*.json")))}
json.dump({"command": "bash bench/request_costs_ab.sh " + " ".join(sys.argv[3:]), "runs": runs}, open(sys.argv[2], "w"), indent=1)
PY
