"""Pinned pool arrays through ``stream_map`` and ``MapJob`` against the link's floor, one run.

1 GiB of float32 made with ``ringflow.host.empty`` goes in, and the result lands in another pool
array (``out=``): no CPU copy on either side, so the call can only lose to the link by its fill,
drain and host time. Then 1 GiB of ordinary memory goes in with an ordinary result, with a pool
array as ``out`` (only the input is staged) and with the result taken from the pool. Each
configuration's warm calls are interleaved with the others'; the link floor (timed on the GPU)
and each call's check against numpy come from the same process. A second part times what a request's bytes cost the host before the GPU sees
them: a CPU copy into a pinned pool array (numpy on one thread, and torch's copy where torch is
installed) against pinning the caller's own pages (``cuMemHostRegister`` then unregister), for
the ``requests`` workload's sizes.

    python3 bench/pool_link_check.py --device cuda:0 --out FILE [--mib 1024] [--calls 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _script import header, write

import ringflow as rf
from ringflow._bench import baselines, kernels, workloads
from ringflow._pipeline import whole_array

MiB = 1 << 20


def timed_calls(configs: dict, check, calls: int) -> dict:
    """Per configuration: whether its result is right, and ``calls`` warm call times (ms). Rounds
    go over every configuration in turn; within a round each is called once untimed first, as a
    repeated call of one shape is (the warm cache keeps two shapes per device)."""
    out = {name: {"correct": check(call()), "ms": []} for name, call in configs.items()}
    for _ in range(calls):
        for name, call in configs.items():
            call()
            t0 = time.perf_counter()
            call()
            out[name]["ms"].append(1e3 * (time.perf_counter() - t0))
    for c in out.values():
        c.update({"ms_median": statistics.median(c["ms"]), "ms_min": min(c["ms"]), "ms_max": max(c["ms"])})
    return out


def pool_calls(dev, mib: int, calls: int) -> dict:
    """1 GiB (``mib``) through each configuration: pool arrays in and out on both engines and at
    several chunk sizes, then an ordinary (pageable) input with an ordinary result, with a pool
    array given as ``out``, and with the result taken from the pool (``POOLED_OUT``)."""
    f = kernels.scale_shift()
    n = mib * MiB // 4
    xo = workloads.fresh_random(n, seed=1)
    x = rf.host.empty(n, np.float32, device=dev)
    x[:] = xo
    y = rf.host.empty(n, np.float32, device=dev)
    expected = xo * np.float32(2) + np.float32(1)

    def check(result):
        ok = bool(np.array_equal(result, expected))
        result[:1] = 0  # the next check sees this call's writes, not a previous call's
        return ok

    def pooled_out(call):
        def run():
            whole_array.POOLED_OUT = True
            try:
                return call()
            finally:
                whole_array.POOLED_OUT = False
        return run

    configs = {f"pool in, pool out: stream_map chunk {c}": (lambda c=c: rf.stream_map(f, x, y, device=dev, chunk_bytes=c))
               for c in ("auto", 8 * MiB, 32 * MiB)}
    jobs = {"MapJob": rf.MapJob(f, x, y, device=dev), "MapJob graph": rf.MapJob(f, x, y, device=dev, graph=True)}
    for name, job in jobs.items():
        configs[f"pool in, pool out: {name}"] = job
    configs["pageable in, new ordinary out"] = lambda: rf.stream_map(f, xo, device=dev)
    configs["pageable in, out= a pool array"] = lambda: rf.stream_map(f, xo, y, device=dev)
    configs["pageable in, result from the pool (POOLED_OUT)"] = pooled_out(lambda: rf.stream_map(f, xo, device=dev))
    out: dict = {"size_bytes": x.nbytes, "cases": timed_calls(configs, check, calls)}
    for job in jobs.values():
        job.close()
    try:
        floors = baselines.link_floor(x.nbytes, x.nbytes)
    except baselines.BaselineUnavailable as exc:  # a dry run on the simulated GPU
        floors = {"error": str(exc)}
    out["floors"] = floors
    for c in out["cases"].values():
        c["over_link_floor"] = c["ms_median"] / floors["link_floor_ms"] if "link_floor_ms" in floors else None
    return out


def pooled_out_costs(dev, mib: int, kept: int = 3) -> dict:
    """What a result from the pool costs where the pool has no block to reuse: ``stream_map`` of
    ``mib`` MiB of ordinary memory on a pool emptied first, each call's result kept (a new block
    pinned for each), against the same calls with ordinary results, interleaved (ms)."""
    f = kernels.scale_shift()
    xo = workloads.fresh_random(mib * MiB // 4, seed=3)
    out: dict = {"pooled_kept_ms": [], "ordinary_kept_ms": [], "pinned_per_call": []}
    rf.stream_map(f, xo, device=dev)  # warm both paths' engines on ordinary results
    for _ in range(2):
        held: dict = {"pooled": [], "ordinary": []}
        rf.host.release_cached(device=dev)
        for _ in range(kept):
            for name in ("pooled", "ordinary"):
                whole_array.POOLED_OUT = name == "pooled"
                before = rf.host.stats(device=dev).allocations
                t0 = time.perf_counter()
                held[name].append(rf.stream_map(f, xo, device=dev))
                out[f"{name}_kept_ms"].append(1e3 * (time.perf_counter() - t0))
                if name == "pooled":
                    out["pinned_per_call"].append(rf.host.stats(device=dev).allocations - before)
        whole_array.POOLED_OUT = False
        del held
    return out


def staging_costs(dev, count: int) -> dict:
    """Per request of the ``requests`` workload's sizes (cold sources, as the workload's are):
    the host microseconds to make its bytes readable by the GPU, by each way."""
    rng = np.random.default_rng(3)
    chunk = 8 * MiB
    sizes = np.minimum(chunk // 4, np.maximum(1024, rng.lognormal(np.log(MiB // 4), 1.0, count).astype(int)))
    items = [workloads.fresh_random(int(s), seed=i) for i, s in enumerate(sizes)]
    dst = rf.host.empty(chunk // 4, np.float32, device=dev)
    ways = {"numpy copy into a pool array": lambda it: np.copyto(dst[:it.size], it)}
    try:
        import torch

        tdst = torch.from_numpy(dst)
        for threads in (2, 4, 8, 16):
            def torch_copy(it, threads=threads):
                torch.set_num_threads(threads)
                tdst[:it.size].copy_(torch.from_numpy(it))
            ways[f"torch copy_ ({threads} threads)"] = torch_copy
    except ImportError:
        pass
    try:
        import numexpr

        for threads in (2, 4, 8, 16):
            def numexpr_copy(it, threads=threads):
                numexpr.set_num_threads(threads)
                numexpr.evaluate("it", out=dst[:it.size])
            ways[f"numexpr ({threads} threads)"] = numexpr_copy
    except ImportError:
        pass
    try:
        from cuda.bindings import driver as cu

        page = 4096

        def register(it):
            start = it.ctypes.data // page * page
            end = -(-(it.ctypes.data + it.nbytes) // page) * page
            (err,) = cu.cuMemHostRegister(start, end - start, 0)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemHostRegister: {err}")
            (err,) = cu.cuMemHostUnregister(start)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemHostUnregister: {err}")

        ways["cuMemHostRegister + unregister the item's pages"] = register
    except ImportError:
        pass
    out: dict = {"count": count, "mean_bytes": float(np.mean([it.nbytes for it in items])), "ways": {}}
    for name, way in ways.items():
        try:
            for it in items[:20]:
                way(it)
            us = []
            for it in items:
                t0 = time.perf_counter()
                way(it)
                us.append(1e6 * (time.perf_counter() - t0))
            total = sum(us)
            out["ways"][name] = {"us_median": statistics.median(us), "us_mean": total / len(us),
                                 "GBps": sum(it.nbytes for it in items) / total / 1e3}
        except Exception as exc:  # noqa: BLE001 - one way failing leaves the others' figures
            out["ways"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--count", type=int, default=600)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    out = header(repr(dev))
    out["staging_costs"] = staging_costs(dev, args.count)
    print(out["staging_costs"], flush=True)
    out["pooled_out_costs"] = pooled_out_costs(dev, args.mib)
    print({k: [round(v, 1) for v in vs] for k, vs in out["pooled_out_costs"].items()}, flush=True)
    out["pool_calls"] = pool_calls(dev, args.mib, args.calls)
    for name, c in out["pool_calls"]["cases"].items():
        print(f"{name}: {c['ms_median']:.2f} ms ({c['over_link_floor']}x link floor) correct={c['correct']}",
              flush=True)
    print("link floor", out["pool_calls"]["floors"].get("link_floor_ms"), flush=True)
    write(out, args.out)


if __name__ == "__main__":
    main()
