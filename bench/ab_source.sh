#!/usr/bin/env bash
# A change against its base on one machine: the request measurements run under the base's source
# and this tree's, interleaved, one process a run (machines differ from run to run; ratios are
# taken within one machine only):
#   git archive BASE src | gzip > base-src.tar.gz
#   bash bench/ab_source.sh ROUNDS base-src.tar.gz
# Each round runs, for the base and then this tree: `ringflow bench requests` and
# bench/large_submit_parts.py (closed and open loop, the parts of `submit` by item size).
# Results: $OUT/ab.json (every run's figures and the medians by source), $OUT/ab-log.txt.
set -o pipefail
ROUNDS=${1:?rounds}; BASE_TAR=${2:?base source tarball}
OUT=${OUT:-/tmp/ringflow-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda:0}  # sim, with BENCH_ARGS=--quick PARTS_ARGS="--count 40": a check of the script itself
LOG="$OUT/ab-log.txt"
source "$(dirname "$0")/_ab.sh"
ab_run() {  # VARIANT ROUND SRC
  echo "== round $2, $1: requests" | tee -a "$LOG"
  PYTHONPATH=$3 timeout 200 python3 -m ringflow._cli bench requests $BENCH_ARGS --device "$DEVICE" --out "$AB_WORK/req-$1-$2" \
    2>&1 | tail -8 | tee -a "$LOG"
  echo "== round $2, $1: large_submit_parts" | tee -a "$LOG"
  PYTHONPATH=$3 timeout 150 python3 bench/large_submit_parts.py --device "$DEVICE" --rounds 1 $PARTS_ARGS \
    --out "$AB_WORK/parts-$1-$2.json" 2>&1 | tail -4 | tee -a "$LOG"
}
ab_rounds "$ROUNDS" "$BASE_TAR"
python3 - "$AB_WORK" "$ROUNDS" "$OUT/ab.json" <<'PY'
import glob, json, statistics, sys
work, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {"base": [], "this": []}
for r in range(1, rounds + 1):
    for v in runs:
        row = {"round": r}
        for f in glob.glob(f"{work}/req-{v}-{r}/*.json"):
            w = json.load(open(f)).get("workloads", {}).get("requests")
            if w:
                row["requests"] = {k: w.get(k) for k in (
                    "capacity_per_s", "ringflow_vs_torch_ring", "ringflow_vs_torch_naive", "isolated_p99_ms",
                    "p99_80_over_isolated", "p99_80_perfect_fifo_over_isolated", "correct")}
                row["git_commit"], row["source_digest"] = (json.load(open(f)).get(k) for k in ("git_commit", "source_digest"))
        try:
            p = json.load(open(f"{work}/parts-{v}-{r}.json"))
            row["large_submit_parts"] = p["rounds"][0]
            row["source_digest_parts"] = p.get("source_digest")
        except (OSError, ValueError, KeyError, IndexError) as exc:
            row["large_submit_parts_error"] = repr(exc)
        runs[v].append(row)


def med(v, path):
    vals = []
    for row in runs[v]:
        x = row
        for k in path:
            x = x.get(k) if isinstance(x, dict) else None
        if x is None and "lock_wait" in path and "large_submit_parts" in row:
            x = 0.0  # no call waited for the driver's lock
        if isinstance(x, (int, float)):
            vals.append(x)
    return statistics.median(vals) if vals else None


paths = {"capacity_per_s": ("requests", "capacity_per_s"), "vs_torch_ring": ("requests", "ringflow_vs_torch_ring"),
         "p99_80_over_isolated": ("requests", "p99_80_over_isolated"),
         "parts_capacity_per_s": ("large_submit_parts", "capacity_per_s"),
         "parts_open_p99_ms": ("large_submit_parts", "p99_ms"),
         "large_submit_p50_us_closed": ("large_submit_parts", "closed", "large", "submit", "p50_us"),
         "large_submit_p50_us_open": ("large_submit_parts", "open", "large", "submit", "p50_us"),
         "large_lock_wait_us_per_request_open": ("large_submit_parts", "open", "large", "lock_wait", "mean_us_per_request"),
         "small_submit_p50_us_open": ("large_submit_parts", "open", "small", "submit", "p50_us"),
         "small_lock_wait_us_per_request_open": ("large_submit_parts", "open", "small", "lock_wait", "mean_us_per_request")}
medians = {v: {name: med(v, p) for name, p in paths.items()} for v in runs}
json.dump({"rounds": rounds, "runs": runs, "medians": medians}, open(out, "w"), indent=1)
for v in runs:
    print(v, {k: (round(x, 3) if isinstance(x, float) else x) for k, x in medians[v].items()})
PY
