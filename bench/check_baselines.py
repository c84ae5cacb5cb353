#!/usr/bin/env python3
"""Run every baseline of ringflow._bench.baselines on the GPU, small and representative sizes,
in one device-machine call; write JSON to $OUT/baselines.json after every step (so a timeout
keeps what finished) and print a short table last.

Sizes: the `seed` workload (float32 in pinned memory, 64 iterations of v*0.999+0.001, in place on
the device) at 16 MiB and 256 MiB; the `pageable` workload (an ordinary numpy array in, a new
array out, y = x*2+1) at 16 MiB and 1 GiB; the link and host floors for each.

    PYTHONPATH=src python3 bench/check_baselines.py [--quick] [--budget-s 330]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ringflow._bench import baselines as bl  # noqa: E402
from ringflow._bench import native  # noqa: E402

MiB = 1 << 20


def env() -> dict:
    info = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "python": sys.version.split()[0],
            "platform": platform.platform(), "cpus": os.cpu_count(), "versions": bl.versions(),
            "nvcc": native.find_nvcc(), "nvcc_version": native.nvcc_version(), "availability": bl.availability()}
    try:
        q = "name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem,memory.total"
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        info["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    try:
        import torch

        info["device"] = torch.cuda.get_device_name(0)
        info["torch_cuda"] = torch.version.cuda
    except Exception as exc:  # noqa: BLE001
        info["device"] = f"unknown ({type(exc).__name__}: {exc})"
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ringflow-baselines"))
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip the steps left once this much time has gone")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "baselines.json"
    start = time.perf_counter()
    results: dict = {"command": "PYTHONPATH=src python3 bench/check_baselines.py " + " ".join(sys.argv[1:]),
                     "env": env(), "steps": {}}
    print(json.dumps(results["env"], indent=1), flush=True)

    def save():
        results["total_s"] = time.perf_counter() - start
        path.write_text(json.dumps(results, indent=1, default=str))

    def step(name, fn, *a, **kw):
        if time.perf_counter() - start > args.budget_s:
            results["steps"][name] = {"skipped": f"time budget of {args.budget_s} s spent"}
            print(f"-- {name}: skipped (budget)", flush=True)
            save()
            return None
        print(f"-- {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            r = fn(*a, **kw)
        except bl.BaselineUnavailable as exc:
            r = {"skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001 - record and go on with the other steps
            r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        r["wall_s"] = time.perf_counter() - t0
        results["steps"][name] = r
        save()
        short = {k: r[k] for k in ("ms_median", "ms_p10", "ms_p90", "chunks", "streams", "correct", "skipped", "error",
                                   "link_floor_ms", "serial_ms") if k in r}
        print(f"   {name}: {short} ({r['wall_s']:.1f} s)", flush=True)
        return r

    sizes = [("16MiB", 16 * MiB, 16 * MiB)]
    if not args.quick:
        sizes.append(("big", 256 * MiB, 1024 * MiB))
    for tag, seed_bytes, page_bytes in sizes:
        # seed: pinned, in place on the device, 64 iterations
        x = bl.random_input(seed_bytes // 4, seed=11)
        big = tag == "big"
        w, r = (2, 10)
        step(f"seed_{seed_bytes // MiB}MiB.serial", bl.serial_copy_compute_copy, x, "seed", host="pinned", warmup=w,
             repeats=r)
        step(f"seed_{seed_bytes // MiB}MiB.torch_naive", bl.torch_naive, x, "seed", warmup=1, repeats=5)
        step(f"seed_{seed_bytes // MiB}MiB.torch_pipeline_3streams", bl.torch_streams_pipeline, x, "seed",
             chunks=(8, 16, 32, 64, 128), streams=3, host="pinned", warmup=w, repeats=r)
        step(f"seed_{seed_bytes // MiB}MiB.torch_pipeline_4streams", bl.torch_streams_pipeline, x, "seed",
             chunks=(8, 16, 32, 64, 128), streams=4, host="pinned", warmup=w, repeats=r)
        step(f"seed_{seed_bytes // MiB}MiB.cuda_cpp", bl.cuda_cpp_pipeline, x.size, chunks=(8, 16, 32, 64),
             streams=(4, 1), iters=64, kernel="seed", repeats=10, warmup=3)
        step(f"seed_{seed_bytes // MiB}MiB.link_floor", bl.link_floor, x.nbytes, x.nbytes)
        del x
        # pageable: ordinary numpy in, new numpy out, x*2+1
        x = bl.random_input(page_bytes // 4, seed=12)
        reps = 3 if big else 5
        step(f"pageable_{page_bytes // MiB}MiB.serial_staged", bl.serial_copy_compute_copy, x, "scale_shift",
             host="pageable", warmup=1, repeats=reps)
        step(f"pageable_{page_bytes // MiB}MiB.torch_naive", bl.torch_naive, x, "scale_shift", warmup=1, repeats=reps)
        step(f"pageable_{page_bytes // MiB}MiB.torch_pipeline", bl.torch_streams_pipeline, x, "scale_shift",
             chunks=(8, 32, 128), streams=3, host="pageable", warmup=1, repeats=reps)
        step(f"pageable_{page_bytes // MiB}MiB.cuda_cpp_pinned", bl.cuda_cpp_pipeline, x.size, chunks=(8, 16, 32, 64),
             streams=(4, 1), kernel="scale_shift", repeats=5 if big else 10, warmup=2)
        step(f"pageable_{page_bytes // MiB}MiB.link_floor", bl.link_floor, x.nbytes, x.nbytes)
        step(f"pageable_{page_bytes // MiB}MiB.host_floor", bl.host_floor, x.nbytes, repeats=3)
        del x

    save()
    print("\n== summary (ms: median [p10, p90]; correct)")
    for name, r in results["steps"].items():
        if "ms_median" in r:
            extra = f" chunks={r.get('chunks')} streams={r.get('streams')}"
            if "serial_ms" in r:
                extra += f" serial={r['serial_ms']:.3f}"
            print(f"{name:44s} {r['ms_median']:9.3f} [{r['ms_p10']:.3f}, {r['ms_p90']:.3f}] {r['correct']}{extra}")
        elif "link_floor_ms" in r:
            print(f"{name:44s} floor {r['link_floor_ms']:.3f} ms  h2d {r.get('link_h2d_GBps', 0):.1f} "
                  f"d2h {r.get('link_d2h_GBps', 0):.1f} duplex {r.get('link_duplex_GBps', 0):.1f} GB/s "
                  f"ok={r.get('link_correct')}")
        elif "host_copy_in_GBps" in r:
            f = lambda d: " ".join(f"{k}:{v:.1f}" for k, v in d.items())  # noqa: E731
            print(f"{name:44s} in {f(r['host_copy_in_GBps'])} | out {f(r['host_copy_out_GBps'])} | "
                  f"out-fresh {f(r['host_copy_out_fresh_GBps'])} GB/s")
            print(f"{'':44s} register touched/fresh {r['host_register_touched_ms']:.1f}/"
                  f"{r['host_register_fresh_ms']:.1f} ms, unregister {r['host_unregister_touched_ms']:.1f}/"
                  f"{r['host_unregister_fresh_ms']:.1f} ms, first touch "
                  f"{ {k: round(v, 1) for k, v in r['host_first_touch_ms'].items()} } ms")
        else:
            print(f"{name:44s} {r.get('skipped') or r.get('error')}")
    print(f"total {results['total_s']:.1f} s -> {path}")
    bad = [n for n, r in results["steps"].items() if "error" in r or r.get("correct") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
