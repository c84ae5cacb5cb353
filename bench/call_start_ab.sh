#!/usr/bin/env bash
# A change to a warm call's own host time against its base on one machine, interleaved, one
# process a run: for the base's source and then this tree's, each round runs bench/call_start.py
# (the host time from a warm call to its first copy, and from its last wait for the GPU to its
# return, for stream_map and MapJob). Ratios are taken within one machine only.
#   git archive BASE src | gzip > build/base-src.tar.gz
#   bash bench/call_start_ab.sh ROUNDS build/base-src.tar.gz
# Results: $OUT/call_start_ab.json (every run's figures, the medians by source), $OUT/ab-log.txt.
set -o pipefail
ROUNDS=${1:?rounds}; BASE_TAR=${2:?base source tarball}
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda:0}
LOG="$OUT/ab-log.txt"
source "$(dirname "$0")/_ab.sh"
ab_run() {  # VARIANT ROUND SRC
  echo "== round $2, $1" | tee -a "$LOG"
  PYTHONPATH=$3 timeout 120 $AB_PIN python3 bench/call_start.py --device "$DEVICE" --calls "${CALLS:-40}" $START_ARGS \
    --out "$AB_WORK/start-$1-$2.json" 2>&1 | tail -4 | cut -c1-300 | tee -a "$LOG"
}
ab_rounds "$ROUNDS" "$BASE_TAR"
python3 - "$AB_WORK" "$ROUNDS" "$OUT/call_start_ab.json" <<'PY'
import json, statistics, sys
work, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {v: [json.load(open(f"{work}/start-{v}-{r}.json")) for r in range(1, rounds + 1)] for v in ("base", "this")}
figures = ("to_first_copy_us", "after_last_sync_us", "call_ms")
medians = {v: {f"{face} {fig}": statistics.median(run["faces"][face][fig]["median"] for run in rs)
               for face in ("stream_map", "MapJob") for fig in figures}
           for v, rs in runs.items()}
json.dump({"rounds": rounds, "runs": runs, "medians": medians}, open(out, "w"), indent=1)
for v, m in medians.items():
    print(v, {k: round(x, 3) for k, x in m.items()})
PY
