"""Where the request path's threads spend their time, from py-spy's raw (collapsed) stacks of
``bench/request_costs.py``: per thread (the submitting thread's ``Pipeline.submit`` calls, the
progress thread's loop), the share of samples by leaf frame (self) and by function anywhere on
the stack (inclusive). Stacks under the pool's pinning of new blocks (the untimed first pass) are
left out of the submitting thread's, and so is the script's check of the results.

    bash bench/pyspy_profile.sh            # on the GPU machine, py-spy installed: the raw files
    python3 bench/pyspy_summary.py --out S.json gil.txt all.txt native.txt

With ``--gil`` py-spy samples only the thread holding the GIL: the shares are of GIL-held time.
With ``--idle`` every sample counts: the shares are of wall time. With ``--native`` the C frames
show too (the GIL's own wait, inside ``pthread_cond_timedwait``, under the call that let go of
it); that mode stops the process for each sample and slows it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

THREADS = {"submit": "Pipeline.submit", "progress": "ProgressThread.step_once"}
LEFT_OUT = ("allocate (", "run_variant.<locals>.<genexpr>")


# the submitting thread's samples in --native mode, by what the leaf frames show it doing
NATIVE_PARTS = (
    ("copying (copy_part)", lambda fr, s: "copy_part" in fr[-1]),
    ("polling for the copy's helpers", lambda fr, s: "ringflow_copy" in s and (
        "sched_yield" in fr[-1] or fr[-1].startswith("ringflow_copy"))),
    ("waking the copy's helpers", lambda fr, s: "sem_post" in fr[-1] and "ringflow_copy" in s),
    ("taking the GIL back after the copy's ctypes call", lambda fr, s: "pthread_cond" in s and any(
        "_ctypes" in f for f in fr[-3:])),
    ("waiting for a lock (the driver's, the batch lock)", lambda fr, s: "PyThread_acquire_lock_timed" in s),
    ("taking the GIL back after a numpy copy", lambda fr, s: "raw_array_assign_array" in s and "pthread_cond" in s),
    ("another condition wait", lambda fr, s: "pthread_cond" in s),
)


def native_parts(path: str) -> dict:
    """The submitting thread's samples of a ``--native`` profile split by :data:`NATIVE_PARTS`
    (the first that matches; the rest is Python and everything else), as shares."""
    parts: collections.Counter = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if THREADS["submit"] not in stack or any(x in stack for x in LEFT_OUT):
                continue
            frames = stack.split(";")
            name = next((n for n, match in NATIVE_PARTS if match(frames, stack)), "Python and the rest")
            parts[name] += int(count)
    total = sum(parts.values())
    return {k: round(v / total, 4) for k, v in parts.most_common()} if total else {}


def summarize(path: str, top: int) -> dict:
    """Per thread: samples counted, and the ``top`` leaf frames and functions by share."""
    leaf = {name: collections.Counter() for name in THREADS}
    incl = {name: collections.Counter() for name in THREADS}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            name = next((n for n, marker in THREADS.items() if marker in stack), None)
            if name is None or any(x in stack for x in LEFT_OUT):
                continue
            n = int(count)
            frames = stack.split(";")[1:]  # the first is py-spy's thread label
            leaf[name][frames[-1]] += n
            for fn in {re.sub(r":\d+\)$", ")", fr) for fr in frames}:
                incl[name][fn] += n
    out = {}
    for name in THREADS:
        total = sum(leaf[name].values())
        share = (lambda c: [[k, round(v / total, 4)] for k, v in c.most_common(top)]) if total else (lambda c: [])
        out[name] = {"samples": total, "self": share(leaf[name]), "inclusive": share(incl[name])}
    if any(".so)" in k for k in leaf["submit"]):  # C frames: a --native profile
        out["submit_native_parts"] = native_parts(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", nargs="+", help="py-spy record -f raw outputs")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    result = {os.path.basename(p): summarize(p, args.top) for p in args.raw}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
