#!/usr/bin/env bash
# A change to the whole-array path against its base on one machine, interleaved, one process a
# run: for the base's source and then this tree's, each round runs bench/diagnose_stream_map_gap.py
# (a warm stream_map call's time outside its engine, against MapJob's) and bench/cpp_rounds.py
# (both faces against the hand-written C++ program, two rounds). Ratios are taken within one
# machine only.
#   git archive BASE src | gzip > build/base-src.tar.gz
#   bash bench/stream_map_ab.sh ROUNDS build/base-src.tar.gz
# Results: $OUT/stream_map_ab.json (every run's figures, the medians by source), $OUT/ab-log.txt.
set -o pipefail
ROUNDS=${1:?rounds}; BASE_TAR=${2:?base source tarball}
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda:0}  # sim, with GAP_ARGS="--mib 16 --chunk-mib 2 --calls 1 --workloads seed"
# ROUNDS_ARGS="--mib 16 --calls 1 --workloads seed": a check of the script itself
LOG="$OUT/ab-log.txt"
source "$(dirname "$0")/_ab.sh"
ab_run() {  # VARIANT ROUND SRC
  echo "== round $2, $1" | tee -a "$LOG"
  PYTHONPATH=$3 timeout 120 $AB_PIN python3 bench/diagnose_stream_map_gap.py --device "$DEVICE" --workloads seed,compute-bound \
    --chunk-mib 8 --calls 21 $GAP_ARGS --out "$AB_WORK/gap-$1-$2.json" 2>&1 | tail -2 | tee -a "$LOG"
  PYTHONPATH=$3 timeout 200 $AB_PIN python3 bench/cpp_rounds.py --device "$DEVICE" --rounds 2 $ROUNDS_ARGS \
    --out "$AB_WORK/rounds-$1-$2.json" 2>&1 | tail -6 | tee -a "$LOG"
}
ab_rounds "$ROUNDS" "$BASE_TAR"
python3 - "$AB_WORK" "$ROUNDS" "$OUT/stream_map_ab.json" <<'PY'
import json, statistics, sys
work, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {v: [{"gap": json.load(open(f"{work}/gap-{v}-{r}.json")), "rounds": json.load(open(f"{work}/rounds-{v}-{r}.json"))}
            for r in range(1, rounds + 1)] for v in ("base", "this")}
medians = {}
for v, rs in runs.items():
    m = {}
    for row in (row for run in rs for row in run["gap"]["rows"]):
        for face in ("MapJob", "stream_map"):
            m.setdefault(f"{row['workload']} {face} outside_run_ms", []).append(row[face]["outside_run_ms"])
    for w in (w for run in rs for w in run["rounds"]["workloads"]):
        for rd in w["rounds"]:
            for face, ratio in rd["ratio"].items():
                if ratio is not None:
                    m.setdefault(f"{w['workload']} {face} over C++", []).append(ratio)
    medians[v] = {k: statistics.median(vals) for k, vals in m.items()}
json.dump({"rounds": rounds, "runs": runs, "medians": medians,
           "source_digest": {v: rs[0]["gap"].get("source_digest") for v, rs in runs.items()}}, open(out, "w"), indent=1)
for v in medians:
    print(v, {k: round(x, 4) for k, x in medians[v].items()})
PY
