#!/usr/bin/env bash
# The request path's threads sampled by py-spy (which the GPU machine lacks: bring its wheel, and
# put its bin/ on PATH), the staged requests of bench/request_costs.py in a closed loop, 10 passes:
#   bash bench/pyspy_profile.sh
# Writes $OUT/gil.txt (GIL-held samples only), all.txt (every sample, idle ones too), native.txt
# (C frames too; py-spy stops the process for each sample, which slows it), each run's
# request_costs JSON, and the summary bench/pyspy_summary.py makes of the three.
set -o pipefail
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
command -v py-spy >/dev/null || { echo "py-spy not found on PATH" >&2; exit 1; }
RC="bench/request_costs.py --device cuda:0 --count 1000 --hz 0 --variants staged --no-torch --passes 10"
py-spy record --nonblocking --gil --threads -r 1000 -f raw -o "$OUT/gil.txt" -- python3 $RC --out "$OUT/rc-gil.json"
py-spy record --nonblocking --threads --idle -r 1000 -f raw -o "$OUT/all.txt" -- python3 $RC --out "$OUT/rc-all.json"
py-spy record --native --threads --idle -r 250 -f raw -o "$OUT/native.txt" -- python3 $RC --out "$OUT/rc-native.json"
python3 bench/pyspy_summary.py --out "$OUT/pyspy-summary.json" "$OUT/gil.txt" "$OUT/all.txt" "$OUT/native.txt"
