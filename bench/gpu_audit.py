"""Probes of cases where the simulated GPU and CUDA could differ; prints one JSON object.

    python3 bench/gpu_audit.py --device cuda:0 --out FILE
"""

from __future__ import annotations

import argparse
import json
import logging
import traceback

import numpy as np

import ringflow as rf


def _try(fn):
    try:
        return {"ok": True, "value": fn()}
    except Exception as exc:  # a probe reports what happened, whatever it was
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400],
                "where": traceback.format_exc().strip().splitlines()[-3][:200]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out")
    a = ap.parse_args()
    res = {}
    warned: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            warned.append(record.getMessage()[:300])
    logging.getLogger("ringflow").addHandler(Keep(logging.WARNING))
    for array in ("cupy", "torch"):
        dev = rf.device(a.device, array=array) if a.device != "sim" else rf.device("sim")

        def double(x, y):
            y[...] = x * 2

        def misaligned():
            raw = np.zeros(4 * 100_001 + 1, np.uint8)
            x = np.frombuffer(raw.data, np.float32, count=100_000, offset=1)
            x[...] = np.arange(100_000, dtype=np.float32)
            y = rf.stream_map(double, x, device=dev, chunk_bytes=64 << 10)
            return bool(np.array_equal(y, x * 2))
        res[f"{array}/misaligned-host-array"] = _try(misaligned)

        for dt in ("datetime64[ns]", "U3", "complex64", "float16", "bool"):
            def odd_dtype(dt=dt):
                x = np.zeros(1000, dtype=dt)

                def copy(x, y):
                    y[...] = x
                y = rf.stream_map(copy, x, device=dev, chunk_bytes=1 << 12)
                return bool(np.array_equal(y, x))
            res[f"{array}/dtype-{dt}"] = _try(odd_dtype)

        for ndim in (26, 32, 40, 64):
            def many_dims(ndim=ndim):
                shape = (64,) + (1,) * (ndim - 2) + (16,)
                x = np.random.rand(*shape).astype(np.float32)
                y = rf.stream_map(double, x, device=dev, chunk_bytes=1 << 10)
                return bool(np.array_equal(y, x * 2))
            res[f"{array}/ndim-{ndim}"] = _try(many_dims)

        def graph_state():
            calls = []
            scale = [1.0]
            if a.device == "sim":
                def f(x, y):
                    calls.append(1)
                    np.multiply(x, np.float32(scale[0]), out=y)
            elif array == "cupy":
                import cupy as cp

                def f(x, y):
                    calls.append(1)
                    cp.multiply(x, np.float32(scale[0]), out=y)  # no temporary: capturable
            else:
                import torch

                def f(x, y):
                    calls.append(1)
                    torch.mul(x, scale[0], out=y)
            x = np.ones(1 << 16, np.float32)
            out = np.empty_like(x)
            job = rf.MapJob(f, x, out, device=dev, chunk_bytes=1 << 14, host="register", graph=True)
            seen = []
            for i in range(4):
                scale[0] = float(i + 1)
                job()
                seen.append({"out0": float(job.out[0]), "replayed": job.replays_graph})
            info = {"engine": job.engine, "warnings": list(warned)}
            warned.clear()
            job.close()
            return {"f_calls": len(calls), "chunks": 16, "per_call": seen, **info}
        res[f"{array}/graph-python-state"] = _try(graph_state)

        def shared_page_registrations():
            raw = np.zeros(1 << 20, np.float32)
            a1, a2 = raw[: 1000], raw[1000: 2000]  # one page, two arrays
            o1, o2 = np.empty_like(a1), np.empty_like(a2)
            a1[...] = 1
            a2[...] = 2
            j1 = rf.MapJob(double, a1, o1, device=dev, host="register")
            j2 = rf.MapJob(double, a2, o2, device=dev, host="register")
            j1()
            j2()
            j1.close()
            j2()
            j2.close()
            return bool((o1 == 2).all() and (o2 == 4).all())
        res[f"{array}/page-sharing-registrations"] = _try(shared_page_registrations)
    res["warnings"] = warned
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
