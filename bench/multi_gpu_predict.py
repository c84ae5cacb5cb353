"""What simulated H200s of one host and the planner predict for a run on one GPU against several.

Every row of a multi-GPU measurement (``bench/multi_gpu_check.py``, ``bench/multi_gpu_requests.py``)
on ``"sim:0"``, ``"sim:1"``, ... (profile ``h200-pcie5``: each device has its own link and
clock, their host copies share the host's copy rate), for 1 and 2 devices (and 4 with
``--four``):

* ``seed``: ``stream_map`` of float32 in place, registered (``host="register"``), the seed
  workload's 64-iteration affine kernel at the chunk size ``ringflow bench seed`` plans for it;
  ``--mib-per-gpu`` on every device (N devices move N times the bytes of one);
* ``balanced``: the same with the kernel iterated until a chunk's compute takes one H2D copy's
  time (``ringflow bench balanced``'s calibration);
* ``pageable``: ``--pageable-mib`` of ordinary numpy memory in all, staged (``host="stage"``), a
  new array out, ``bench/multi_gpu_check.py``'s kernel and chunk size;
* ``pageable_workers_W`` (with ``--extra-workers W``): the same with ``W`` staging workers a
  device (the simulated GPU gets 4 by default, a GPU of a 16-core host 15);
* ``requests``: a ``Pipeline``'s closed-loop capacity on the requests workload's items
  (``bench/multi_gpu_requests.py``'s simulated prediction).

A whole-array row's time is the largest advance of a device's clock over one warm call
(unprofiled, after a call that sets the engines up), as ``ringflow bench`` times the simulated
GPU. ``ratio``: bytes (requests) per second of virtual time on N devices over one device's;
where the total is the same for every N (pageable, requests) that is one device's time over N
devices'. Beside each whole-array figure: ``ringflow._plan.predict_devices`` for the same job.
The simulated kernels compute ``--numeric-iters`` iterations in numpy (a sample of the result is
checked) while the simulation charges the time of all of them; virtual time does not depend on
the host's speed.

    PYTHONPATH=src python3 bench/multi_gpu_predict.py --out FILE [--four] [--extra-workers 15]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Callable, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow import _plan as plan  # noqa: E402
from ringflow._bench import kernels, workloads  # noqa: E402
from ringflow._pipeline.sizing import default_workers  # noqa: E402
from _script import header, write  # noqa: E402
from multi_gpu_requests import simulated_capacity  # noqa: E402
from pinned_results_check import request_items  # noqa: E402

MiB = 1 << 20
SEED_ITERS = 64  # the seed workload's kernel
PAGEABLE_ITERS = 1  # bench/multi_gpu_check.py's staged job
PAGEABLE_CHUNK = 8 * MiB
REQUEST_CHUNK = 8 * MiB
# what the measurement on two H200s runs
REAL_SIZES = {"mib_per_gpu": 256, "pageable_mib": 1024}
RATIO = ("bytes (for requests: requests) per second of virtual time on N devices over one device's; "
         "seed and balanced move --mib-per-gpu on every device, so N devices move N times the bytes; "
         "pageable and requests do the same total work on every N, so their ratio is also one device's "
         "time over N devices'")


def sim_devices(n: int) -> list:
    """The process's simulated GPUs ``"sim:0"`` .. ``"sim:{n-1}"``: GPUs of one simulated host."""
    return [rf.device(f"sim:{i}") for i in range(n)]


def virtual_ms(devs, call: Callable) -> tuple:
    """``(ms, call())``: the largest advance of a device's virtual clock over ``call``."""
    t0 = [d.now for d in devs]
    result = call()
    return max(d.now - a for d, a in zip(devs, t0)) * 1e3, result


def affine_sample_ok(y: np.ndarray, x0: float, iters: int) -> bool:
    """Every 4099th element of ``y`` against ``iters`` steps of the affine kernel from ``x0``."""
    want = kernels.affine_expected(np.array([x0], np.float64), iters)[0]
    tol = workloads.affine_tolerance(iters)
    return bool(np.allclose(y[::4099], want, rtol=tol, atol=tol))


def seed_chunk_bytes(f, nbytes: int, profile: str = "h200-pcie5") -> int:
    """The chunk size ``ringflow bench seed`` plans for ``f`` over ``nbytes`` pinned in place."""
    return plan.choose_chunk_bytes(profile, nbytes, host_stages=False,
                                   compute_s_per_byte=f.sim_seconds(MiB) / MiB, align=4).chunk_bytes


def in_place_ms(f, mib_per_gpu: int, n: int, chunk_bytes: int) -> dict:
    """One warm ``stream_map`` of ``f`` over ``mib_per_gpu`` MiB of float32 a device, registered and
    processed in place, on ``n`` simulated GPUs of one host: ``wall_ms``, ``bytes_in``, ``correct``."""
    devs = sim_devices(n)
    x = np.full(mib_per_gpu * n * MiB // 4, 0.5, np.float32)

    def call():
        return rf.stream_map(f, x, x, device=devs, chunk_bytes=chunk_bytes, host="register", inplace=True)

    call()  # sets every shard's engine up
    ms, _ = virtual_ms(devs, call)
    ok = affine_sample_ok(x, 0.5, 2 * f.numeric_iters)
    for d in devs:
        rf.drop_warm_pipelines(d)
    return {"wall_ms": ms, "bytes_in": x.nbytes, "correct": ok}


def pageable_ms(mib: int, n: int, chunk_bytes: int = PAGEABLE_CHUNK, workers: Optional[int] = None) -> dict:
    """One warm staged ``stream_map`` (``host="stage"``, a new array out) of ``mib`` MiB of ordinary
    float32 memory in all on ``n`` simulated GPUs of one host: ``wall_ms``, ``bytes_in``, ``correct``."""
    devs = sim_devices(n)
    f = kernels.affine(PAGEABLE_ITERS, numeric_iters=1)
    x = np.full(mib * MiB // 4, 0.75, np.float32)
    extra = {} if workers is None else {"workers": workers}

    def call():
        return rf.stream_map(f, x, device=devs, chunk_bytes=chunk_bytes, host="stage", **extra)

    call()
    ms, y = virtual_ms(devs, call)
    ok = affine_sample_ok(y, 0.75, f.numeric_iters)
    del y
    for d in devs:
        rf.drop_warm_pipelines(d)
    return {"wall_ms": ms, "bytes_in": x.nbytes, "correct": ok}


def planner_ms(f, total_bytes: int, chunk_bytes: int, n: int, *, host_stages: bool, workers: int = 1,
               profile: str = "h200-pcie5") -> float:
    """``predict_devices``'s time (ms) for the job on ``n`` GPUs of one host."""
    return plan.predict_devices(profile, total_bytes, chunk_bytes, n,
                                compute_s_per_byte=f.sim_seconds(chunk_bytes) / chunk_bytes,
                                workers=workers, host_stages=host_stages).predicted_s * 1e3


def whole_array_row(counts, run: Callable[[int], dict], planned: Callable[[int], float], **about) -> dict:
    """A row: per device count the simulated time, bytes/s and the planner's; ratios against one."""
    per = {}
    for n in counts:
        r = run(n)
        p = planned(n)
        per[str(n)] = {**r, "GBps": r["bytes_in"] / r["wall_ms"] / 1e6, "planner_ms": p,
                       "planner_GBps": r["bytes_in"] / p / 1e6}
        print(f"  {n} device(s): {r['wall_ms']:.3f} ms simulated, {p:.3f} ms planned", flush=True)
    one = per["1"]
    return {**about, "devices": per,
            "ratio": {k: v["GBps"] / one["GBps"] for k, v in per.items() if k != "1"},
            "planner_ratio": {k: v["planner_GBps"] / one["planner_GBps"] for k, v in per.items() if k != "1"},
            "correct": all(v["correct"] for v in per.values())}


def in_place_row(name: str, iters: int, mib_per_gpu: int, counts, numeric_iters: int) -> dict:
    f = kernels.affine(iters, numeric_iters=min(iters, numeric_iters))
    chunk = seed_chunk_bytes(f, mib_per_gpu * MiB)
    print(f"{name}: {iters} iterations, chunks of {chunk / MiB:g} MiB", flush=True)
    return whole_array_row(counts, lambda n: in_place_ms(f, mib_per_gpu, n, chunk),
                           lambda n: planner_ms(f, mib_per_gpu * n * MiB, chunk, n, host_stages=False),
                           job="stream_map, float32 registered and processed in place (host='register')",
                           mib_per_gpu=mib_per_gpu, iters=iters, numeric_iters=f.numeric_iters, chunk_bytes=chunk)


def pageable_row(mib: int, counts, workers: Optional[int] = None) -> dict:
    f = kernels.affine(PAGEABLE_ITERS, numeric_iters=1)
    w = workers or default_workers(rf.device("sim:0"))  # what stream_map gives each simulated GPU
    print(f"pageable: {mib} MiB staged, {w} workers a device", flush=True)
    return whole_array_row(counts, lambda n: pageable_ms(mib, n, workers=workers),
                           lambda n: planner_ms(f, mib * MiB, PAGEABLE_CHUNK, n, host_stages=True, workers=w),
                           job="stream_map of ordinary numpy memory, staged (host='stage'), a new array out",
                           total_mib=mib, iters=PAGEABLE_ITERS, chunk_bytes=PAGEABLE_CHUNK, workers_per_device=w)


def requests_row(count: int, counts) -> dict:
    items = request_items(count, REQUEST_CHUNK)
    print(f"requests: {count} items, {sum(it.nbytes for it in items) / MiB:.0f} MiB", flush=True)
    per = {}
    for n in counts:
        per[str(n)] = {"capacity_per_s": simulated_capacity(sim_devices(n), items)}
        print(f"  {n} device(s): {per[str(n)]['capacity_per_s']:.0f}/s", flush=True)
    one = per["1"]["capacity_per_s"]
    return {"job": "Pipeline(scale_shift) closed loop on the requests workload's items (after 30 untimed)",
            "count": count, "bytes_in": int(sum(it.nbytes for it in items)), "devices": per,
            "ratio": {k: v["capacity_per_s"] / one for k, v in per.items() if k != "1"},
            "planner_ratio": None, "planner": "predict_devices models one whole-array job, not a request stream"}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib-per-gpu", type=int, default=REAL_SIZES["mib_per_gpu"])
    ap.add_argument("--pageable-mib", type=int, default=REAL_SIZES["pageable_mib"])
    ap.add_argument("--requests", type=int, default=1000, help="request items (default 1000, as multi_gpu_requests.py)")
    ap.add_argument("--four", action="store_true", help="also 4 devices")
    ap.add_argument("--numeric-iters", type=int, default=1,
                    help="iterations the simulated kernels compute in numpy (the time charged is the full count's)")
    ap.add_argument("--extra-workers", type=int, default=None,
                    help="also the pageable row with this many staging workers a device (the simulated GPU "
                         "has 4; a 16-core host's GPU gets 15)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    counts = (1, 2, 4) if args.four else (1, 2)
    probe = rf.device("sim:0")
    profile = probe.hardware.name
    machine = (f"this CPU host ({cpu_name()}, {os.cpu_count()} cores) running simulated GPUs "
               f"sim:0..sim:{counts[-1] - 1} of one simulated host, profile {profile}")
    out = {**header(machine),
           "versions": {"python": platform.python_version(), "numpy": np.__version__, "ringflow": rf.__version__},
           "simulated": True, "profile": profile, "device_counts": list(counts), "ratio_is": RATIO,
           "sizes": {"mib_per_gpu": args.mib_per_gpu, "pageable_mib": args.pageable_mib,
                     "real_run": REAL_SIZES,
                     "scaled_down": args.mib_per_gpu < REAL_SIZES["mib_per_gpu"]
                     or args.pageable_mib < REAL_SIZES["pageable_mib"]}}
    balanced_iters = workloads.calibrate_iters(probe, args.mib_per_gpu * MiB // 32, 1.0)
    rows = {"seed": in_place_row("seed", SEED_ITERS, args.mib_per_gpu, counts, args.numeric_iters),
            "balanced": in_place_row("balanced", balanced_iters, args.mib_per_gpu, counts, args.numeric_iters),
            "pageable": pageable_row(args.pageable_mib, counts, None)}
    if args.extra_workers:
        rows[f"pageable_workers_{args.extra_workers}"] = pageable_row(args.pageable_mib, counts, args.extra_workers)
    rows["requests"] = requests_row(args.requests, counts)
    out["rows"] = rows
    out["summary"] = {name: {"ratio": r["ratio"], "planner_ratio": r["planner_ratio"]} for name, r in rows.items()}
    for name, s in out["summary"].items():
        planned = "" if s["planner_ratio"] is None else f", planner {s['planner_ratio']}"
        print(f"{name}: ratio {s['ratio']}{planned}", flush=True)
    rf.drop_warm_pipelines()
    write(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
