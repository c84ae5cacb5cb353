"""The planner's choices in two source trees side by side: for every combination of profile
(``h200-pcie5``, ``pcie4-x16``), size (64 MiB, 1 GiB, 4 GiB), workers (1-64), compute (0, 5, 20 ms
a GiB), staged or pinned and result size (as large as the input, a quarter of it), the chunk
``choose_chunk_bytes`` picks, its predicted time, the slots of each ring and the copying threads.
Prints the combinations whose chunk or slots differ. No GPU: the planner only.

    python3 bench/compare_plans.py OLD_SRC NEW_SRC      # e.g. a `git archive` of another commit's src
"""

from __future__ import annotations

import json
import subprocess
import sys

PLANS = r"""
import itertools, json, sys
sys.path.insert(0, sys.argv[1])
from ringflow import _plan as plan
out = []
for prof, total, w, ms, staged, ratio in itertools.product(
        ("h200-pcie5", "pcie4-x16"), (64 << 20, 1 << 30, 4 << 30), (1, 2, 4, 8, 16, 32, 64), (0.0, 5.0, 20.0),
        (True, False), (1.0, 0.25)):
    per_byte = ms * 1e-3 / (1 << 30)
    c = plan.choose_chunk_bytes(prof, total, compute_s_per_byte=per_byte, workers=w, host_stages=staged, out_ratio=ratio)
    t, _ = plan.predict_seconds(prof, total, c.chunk_bytes, compute_s_per_byte=per_byte, workers=w, host_stages=staged,
                                out_ratio=ratio)
    s = plan.plan_slots(t).slots
    out.append([[prof, total, w, ms, staged, ratio], c.chunk_bytes, c.predicted_s,
                [s.host_in, s.device_in, s.device_out, s.host_out], t.workers])
print(json.dumps(out))
"""


def plans(src: str) -> list:
    done = subprocess.run([sys.executable, "-c", PLANS, src], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main(argv=None) -> int:
    old_src, new_src = (argv if argv is not None else sys.argv[1:])[:2]
    old, new = plans(old_src), plans(new_src)
    chunks = slots = 0
    for a, b in zip(old, new):
        if a[1] != b[1]:
            chunks += 1
            print(f"chunk {a[0]}: {a[1] >> 20} MiB -> {b[1] >> 20} MiB ({a[2] * 1e3:.1f} -> {b[2] * 1e3:.1f} ms)")
        elif a[3] != b[3]:
            slots += 1
            print(f"slots {a[0]} ({a[1] >> 20} MiB): {a[3]} -> {b[3]}")
    print(f"{len(old)} combinations: {chunks} chunk choices and {slots} slot plans differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
