"""Host time of each device call a pipeline makes per chunk (copy in, launch, copy out, event
record, stream wait, event query), alone and with a second Python thread busy beside it (what a
submitting thread is to the progress thread): whether a call's cost is its own or the GIL's
hand-back after it.

    PYTHONPATH=src python3 bench/driver_call_costs.py --device cuda:0 --out driver-calls.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time

import numpy as np
from _script import header, write

import ringflow as rf
from ringflow._bench import kernels

MiB = 1 << 20


def per_call_us(fn, calls: int) -> dict:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    out.sort()
    return {"median_us": statistics.median(out), "p90_us": out[int(0.9 * len(out))], "max_us": out[-1]}


def held_gil_calls():
    """libcuda through ``ctypes.PyDLL``: the same driver entry points, called without letting go
    of the GIL (None where libcuda cannot be loaded)."""
    import ctypes

    try:
        lib = ctypes.PyDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuEventQuery.argtypes = [ctypes.c_void_p]
    lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return lib


@contextlib.contextmanager
def resources(dev, nbytes: int):
    """``(host buffer, device buffer, stream, second stream)`` of ``nbytes``, every stream's work
    finished and everything closed at the end."""
    h, d = dev.allocate_host(nbytes), dev.allocate(nbytes)
    s, c = dev.create_stream(), dev.create_stream()
    try:
        yield h, d, s, c
        s.record().sync()
        c.record().sync()
    finally:
        for obj in (s, c, d, h):
            obj.close()


def measure_held(dev, nbytes: int, calls: int, lib) -> dict:
    with resources(dev, nbytes) as (h, d, s, c):
        ev = s.record()
        ev.sync()
        e = int(ev._cc.handle)
        res = {"copy_h2d": per_call_us(lambda: lib.cuMemcpyAsync(d.ptr, h.ptr, nbytes, s.handle), calls),
               "record": per_call_us(lambda: lib.cuEventRecord(e, s.handle), calls)}
        s.record().sync()
        res["wait"] = per_call_us(lambda: lib.cuStreamWaitEvent(c.handle, e, 0), calls)
        res["is_done"] = per_call_us(lambda: lib.cuEventQuery(e), calls)
    return res


def measure(dev, nbytes: int, calls: int) -> dict:
    with resources(dev, nbytes) as (h, d, s, c):
        x = d.array(np.float32, (nbytes // 4,))
        f = kernels.scale_shift()
        ev = s.record()
        ev.sync()
        res = {"copy_h2d": per_call_us(lambda: s.copy(d, h, nbytes), calls)}
        s.record().sync()
        res["launch"] = per_call_us(lambda: c.launch(f, x, x), calls)
        c.record().sync()
        res["copy_d2h"] = per_call_us(lambda: s.copy(h, d, nbytes), calls)
        res["record"] = per_call_us(lambda: s.record(), calls)
        res["wait"] = per_call_us(lambda: c.wait(ev), calls)
        res["is_done"] = per_call_us(lambda: ev.is_done, calls)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    nbytes = args.kib * 1024
    result = {**header(dev.name), "nbytes": nbytes, "calls": args.calls}
    lib = held_gil_calls() if dev.backend == "cuda" else None
    result["alone"] = measure(dev, nbytes, args.calls)
    print("alone", result["alone"], flush=True)
    if lib is not None:
        result["gil_held_alone"] = measure_held(dev, nbytes, args.calls, lib)
        print("GIL held, alone", result["gil_held_alone"], flush=True)
    stop = threading.Event()

    def busy():  # pure Python, as a thread accepting requests is between its C calls
        while not stop.is_set():
            sum(range(200))

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        result["beside_busy_thread"] = measure(dev, nbytes, args.calls)
        if lib is not None:
            result["gil_held_beside_busy_thread"] = measure_held(dev, nbytes, args.calls, lib)
    finally:
        stop.set()
        t.join()
    print("beside a busy thread", result["beside_busy_thread"], flush=True)
    if lib is not None:
        print("GIL held, beside a busy thread", result["gil_held_beside_busy_thread"], flush=True)
    write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
