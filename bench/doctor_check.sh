#!/usr/bin/env bash
# One device-machine call: environment, the GPU tests, then `ringflow doctor --json`.
# Everything lands in $OUT (default /tmp/ringflow-doctor-check): env.txt, pytest.log, junit.xml,
# smoke.log, doctor.json, doctor.err, doctor.txt. Usage on the device machine:  bash bench/doctor_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ringflow-doctor-check}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem --format=csv || true
  python3 -c 'import sys, numpy, cuda.core, cuda.bindings; print(sys.version); print("numpy", numpy.__version__, "cuda.core", cuda.core.__version__, "cuda.bindings", cuda.bindings.__version__)'
  python3 -m pip list 2>/dev/null | grep -i -E '^(cupy|torch|cuda-|nvidia-cuda-nvrtc|rich|pytest)' || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== GPU and backend tests"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/junit.xml" \
  tests/device/cuda tests/test_kernel.py tests/test_doctor.py 2>&1 | tee "$OUT/pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}"

echo "== stream_map smoke (the pipeline on this backend; informative, never fails the run)"
timeout 120 python3 bench/cuda_smoke.py 1024 2>&1 | tee "$OUT/smoke.log"

echo "== ringflow doctor"
timeout 180 python3 -m ringflow._cli doctor --json --device cuda:0 --output "$OUT/doctor.json" > /dev/null 2> "$OUT/doctor.err"
echo "doctor exit: $?"
tail -20 "$OUT/doctor.err"
python3 - "$OUT/doctor.json" <<'PY' 2>&1 | tee "$OUT/doctor.txt"
import json, sys
from rich.console import Console
from ringflow._doctor import render
Console(width=110).print(render(json.load(open(sys.argv[1]))))
PY
