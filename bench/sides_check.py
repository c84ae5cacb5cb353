"""The planner's per-side staging and the scheduler's unstaged host time, against the GPU.

A float32 array (``--mib``, a fraction for arrays under a MiB; y = 2x + 1) through ``stream_map``
with ``--workers`` CPU workers, at each chunk of ``--chunks`` (KiB, ``auto``, or ``default``: no
``chunk_bytes``), in rounds that visit every setting in turn (round 0 warms up and is not kept; medians over the rest).
Every setting's warm pipeline is kept (the device's warm capacity raised for the run), so each
timed call finds its engine built, as a caller's repeated calls do: with the default capacity the
settings evict each other, and a call that builds its engine anew is timed beside one that does
not. Each row records its timed calls that found their engine warm (``warm_calls``) and the first
call's time (``first_ms``, round 0: the engine built).

* ``stage both``: pageable x and a fresh pageable result, ``host="stage"``;
* ``register both``: the same arrays, ``host="register"``; ``auto both``: ``host="auto"``;
* ``stage in, out pinned``: pageable x into an ``rf.host.empty`` result, staging x only (the host
  strategy forced to staging, which ``host="auto"`` may or may not pick);
* ``auto in, out pinned``: the same arrays, ``host="auto"`` (its choice is recorded);
* ``register in, out pinned``: the same arrays, ``host="register"``;
* ``pinned, scheduler``: ``rf.host.empty`` x and result, ``engine="pipeline"`` (unstaged);
* ``pinned, direct``: the same on the direct engine;
* ``MapJob auto both``: a ``MapJob`` over pageable x and a fresh result, ``host="auto"``, which
  weighs one call (its arrays pinned once): its choice and both predictions a call, its set-up
  time, and the median of ``--rounds`` calls after its first (``job_rows`` in the JSON).

Each staged or scheduled row carries ``_plan.predict_seconds`` for the sides it stages and, for
the one-side rows, what a prediction staging both sides gives (the model before it told the sides
apart). Every result is checked against numpy.

    PYTHONPATH=src python3 bench/sides_check.py --device cuda:0 --out FILE
    PYTHONPATH=src python3 bench/sides_check.py --device cuda:0 --mib 0.0625 --chunks default,auto --rounds 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow import _plan as plan  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from ringflow._bench.measure import fresh_random  # noqa: E402
from ringflow._bench.runner import environment  # noqa: E402
from ringflow._pipeline import call_memo, warm, whole_array  # noqa: E402
from ringflow._pipeline.sizing import DEFAULT_CHUNK_BYTES  # noqa: E402
from _script import header, write  # noqa: E402

KiB = 1 << 10

# (name, x pinned, out pinned, host, engine, sides staged for the prediction or None, scheduler)
CASES = (
    ("stage both", False, False, "stage", "auto", (True, True), True),
    ("register both", False, False, "register", "auto", None, None),
    ("auto both", False, False, "auto", "auto", None, None),
    ("stage in, out pinned", False, True, "force-stage", "auto", (True, False), True),
    ("auto in, out pinned", False, True, "auto", "auto", None, None),
    ("register in, out pinned", False, True, "register", "auto", None, None),
    ("pinned, scheduler", True, True, "auto", "pipeline", (False, False), True),
    ("pinned, direct", True, True, "auto", "auto", (False, False), False),
)


class HostChoice:
    """``choose_host_strategy`` as the whole-array layout calls it: forced to staging while
    ``force`` is set; the last strategy it returned (its choice and both predictions) is kept."""

    def __init__(self):
        self.real = whole_array.plan.choose_host_strategy
        self.force = False
        self.last = None

    def __call__(self, *args, **kwargs):
        choice = self.real(*args, **kwargs)
        if self.force:
            choice = plan.HostStrategy("stage", choice.stage_s, choice.register_s)
        self.last = choice
        return choice


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--chunks", default="256,1024,8192,auto")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    profile = dev.hardware
    f = kernels.scale_shift()
    n = int(args.mib * (1 << 20)) // 4
    chunks = [c if c == "auto" else None if c == "default" else int(c) * KiB for c in args.chunks.split(",")]
    choice = HostChoice()
    whole_array.plan.choose_host_strategy = choice
    settings = [(case, c) for case in CASES for c in chunks]
    samples: dict = {(case[0], c): [] for case, c in settings}
    first: dict = {}
    warm_calls = dict.fromkeys(samples, 0)
    # every setting's engine stays parked: none evicts another's between its calls
    warm.WARM.capacity = max(warm.WARM.capacity, len(settings))
    taken: list = []
    take = warm.WARM.take
    warm.WARM.take = lambda *args: taken.append(take(*args)) or taken[-1]
    auto_choice: dict = {}
    pinned_x = rf.host.empty(n, np.float32, device=dev)
    pinned_out = rf.host.empty(n, np.float32, device=dev)
    correct = True
    for r in range(args.rounds + 1):  # round 0 warms every setting up and is not kept
        base = fresh_random(n, seed=r)
        want = base * np.float32(2) + np.float32(1)
        for (name, x_pinned, out_pinned, host, engine, _, _), c in settings:
            x = base.copy()  # new pages each call: registering or staging finds nothing of the last
            if x_pinned:
                pinned_x[:] = x
                x = pinned_x
            out = pinned_out if out_pinned else None
            # the forced and the free choice of the same arrays must each plan anew
            call_memo.MEMO.drop()
            choice.force = host == "force-stage"
            options = dict(host="auto" if host == "force-stage" else host, engine=engine)
            del taken[:]
            t0 = time.perf_counter()
            y = rf.stream_map(f, x, out, device=dev, workers=args.workers, chunk_bytes=c, **options)
            dt = time.perf_counter() - t0
            choice.force = False
            correct = correct and bool(np.array_equal(y, want))
            if host == "auto" and not x_pinned:
                auto_choice[(name, c)] = choice.last
            if r:
                samples[(name, c)].append(dt)
                warm_calls[(name, c)] += any(e is not None for e in taken)
            else:
                first[(name, c)] = dt
            del x, y, out
    rows = []
    for (name, _, _, host, engine, sides, scheduler), c in settings:
        s = samples[(name, c)]
        row = {"case": name, "chunk_bytes": c, "median_ms": statistics.median(s) * 1e3,
               "min_ms": min(s) * 1e3, "max_ms": max(s) * 1e3, "first_ms": first[(name, c)] * 1e3,
               "warm_calls": warm_calls[(name, c)], "host_choice": None}
        strategy = auto_choice.get((name, c))
        if strategy is not None:  # what host="auto" predicted for either strategy, fixed costs included
            row.update(host_choice=strategy.choice, predicted_stage_ms=strategy.stage_s * 1e3,
                       predicted_register_ms=strategy.register_s * 1e3)
        if sides is not None:
            size = min(n * 4, c or DEFAULT_CHUNK_BYTES) if c != "auto" else plan.choose_chunk_bytes(
                profile, n * 4, workers=args.workers, host_stages=sides, scheduler=scheduler, align=4).chunk_bytes
            _, predicted = plan.predict_seconds(profile, n * 4, size, workers=args.workers, host_stages=sides,
                                                scheduler=scheduler)
            row.update(planned_chunk_bytes=size, predicted_ms=predicted * 1e3,
                       host_s_per_chunk=plan.host_seconds_per_chunk(profile, sides, scheduler=scheduler))
            if sides == (True, False):
                _, both = plan.predict_seconds(profile, n * 4, size, workers=args.workers, host_stages=True)
                row["predicted_both_staged_ms"] = both * 1e3
        rows.append(row)
        extra = "".join(f"  {k} {row[k]:.2f}" for k in ("predicted_ms", "predicted_both_staged_ms",
                                                         "predicted_stage_ms", "predicted_register_ms") if k in row)
        print(f"{name:24s} chunk {str(c or 'default'):>8s}: {row['median_ms']:8.2f} ms [{row['min_ms']:.2f}, "
              f"{row['max_ms']:.2f}]  first {row['first_ms']:.2f}{extra}"
              f"{'  chose ' + row['host_choice'] if row['host_choice'] else ''}",
              flush=True)
    job_rows = []
    for c in chunks:
        x = fresh_random(n, seed=args.rounds + 1)
        want = x * np.float32(2) + np.float32(1)
        call_memo.MEMO.drop()
        t0 = time.perf_counter()
        with rf.MapJob(f, x, device=dev, workers=args.workers, chunk_bytes=c) as job:
            setup = time.perf_counter() - t0
            strategy = choice.last
            correct = correct and bool(np.array_equal(job(), want))  # the first call, not kept
            times = []
            for _ in range(max(1, args.rounds)):
                t0 = time.perf_counter()
                y = job()
                times.append(time.perf_counter() - t0)
            correct = correct and bool(np.array_equal(y, want))
            row = {"case": "MapJob auto both", "chunk_bytes": c, "strategy": job.strategy, "engine": job.engine,
                   "setup_ms": setup * 1e3, "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
                   "max_ms": max(times) * 1e3, "predicted_stage_ms": strategy.stage_s * 1e3,
                   "predicted_register_ms": strategy.register_s * 1e3}
        job_rows.append(row)
        print(f"{row['case']:24s} chunk {str(c or 'default'):>8s}: {row['median_ms']:8.2f} ms a call [{row['min_ms']:.2f}, "
              f"{row['max_ms']:.2f}]  set-up {row['setup_ms']:.2f} ms  predicted_stage_ms "
              f"{row['predicted_stage_ms']:.2f}  predicted_register_ms {row['predicted_register_ms']:.2f}  chose "
              f"{row['strategy']}", flush=True)
        del x, y, want
    out = {**header(environment(dev)), "bytes": n * 4, "workers": args.workers, "rounds": args.rounds,
           "profile": profile.name, "correct": correct, "rows": rows, "job_rows": job_rows}
    print("correct:", correct, flush=True)
    write(out, args.out)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
