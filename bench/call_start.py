"""What a warm whole-array call does before its first copy starts and after its last copy ends,
on a real GPU.

    python3 bench/call_start.py --device cuda:0 --out FILE [--mib 256] [--chunk-mib 16] [--calls 30]

For ``stream_map`` and ``MapJob`` over the same pinned, in-place seed input (the direct engine,
as ``ringflow bench``'s seed workload runs): per call, the host time from the call to the
enqueueing of its first copy and the call's whole time (medians and ranges over ``--calls``
warm calls); then a cProfile of the same calls cut off at each call's first copy, so that only
the host work the GPU waits for is in it (functions by their own time per call). The copy
engines idle for that time at the start of every call, where a hand-written program starts its
first copy at once. The same for the call's tail: the host time from the return of its last
wait for the GPU (an event's ``sync``) to the call's return, and a cProfile of only that part;
calls made back to back leave the GPU idle for it too.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from _script import header, pinned_random, write

import ringflow as rf
from ringflow._bench import kernels

MiB = 1 << 20


class Stamps(list):
    """Host times a probed method stamped (:func:`stamp_method`); ``hook``, when set, is called
    at every stamp."""

    hook = None


def stamp_method(cls, name: str, *, after: bool):
    """``(stamps, restore)``: every call of ``cls.name`` appends the host time to ``stamps``, as
    it is called or (``after``) as it returns, and calls ``stamps.hook`` then, until
    ``restore()``."""
    original = getattr(cls, name)
    stamps = Stamps()

    def stamp() -> None:
        stamps.append(time.perf_counter())
        if stamps.hook is not None:
            stamps.hook()

    def probed(self, *args, **kwargs):
        if not after:
            stamp()
        result = original(self, *args, **kwargs)
        if after:
            stamp()
        return result

    setattr(cls, name, probed)
    return stamps, lambda: setattr(cls, name, original)


def first_copy_probe(dev):
    """Stamps of every copy a stream of ``dev``'s kind enqueues, as it is enqueued."""
    probe = dev.create_stream()
    cls = type(probe)
    probe.close()
    return stamp_method(cls, "copy", after=False)


def last_sync_probe(dev):
    """Stamps of every event ``sync`` of ``dev``'s kind, as it returns."""
    stream = dev.create_stream()
    event = stream.record()
    event.sync()
    cls = type(event)
    stream.close()
    return stamp_method(cls, "sync", after=True)


def by_own_time(prof: cProfile.Profile, calls: int, top: int) -> list:
    """The functions a profile saw, by their own time per call, the ``top`` first."""
    stats = pstats.Stats(prof)
    rows = sorted(((tt, nc, ct, func) for func, (_, nc, tt, ct, _) in stats.stats.items()), reverse=True)
    return [{"function": f"{fn[0].rsplit('/src/', 1)[-1]}:{fn[1]}({fn[2]})", "calls_per_call": nc / calls,
             "own_us_per_call": tt / calls * 1e6, "cumulative_us_per_call": ct / calls * 1e6}
            for tt, nc, ct, fn in rows[:top]]


def spread(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    f = kernels.affine(64, numeric_iters=1 if dev.backend == "sim" else None)
    hb, x = pinned_random(dev, args.mib)
    chunk = args.chunk_mib * MiB
    job = rf.MapJob(f, x, x, device=dev, chunk_bytes=chunk, x_buffer=hb, out_buffer=hb, inplace=True)

    def stream_map():
        rf.stream_map(f, x, x, device=dev, chunk_bytes=chunk, x_buffer=hb, out_buffer=hb, inplace=True)

    out = {**header(dev.name if hasattr(dev, "name") else args.device), "device": args.device, "mib": args.mib,
           "chunk_mib": args.chunk_mib, "calls": args.calls, "faces": {}}
    stamps, restore = first_copy_probe(dev)
    ends, restore_sync = last_sync_probe(dev)
    try:
        for face, call in (("stream_map", stream_map), ("MapJob", job)):
            for _ in range(5):  # warm: kernels loaded, pipelines and memo entries made
                call()
            to_first, whole, tail = [], [], []
            for _ in range(args.calls):
                stamps.clear()
                ends.clear()
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                to_first.append((stamps[0] - t0) * 1e6)
                whole.append((t1 - t0) * 1e3)
                tail.append((t1 - ends[-1]) * 1e6)
            prof = cProfile.Profile()
            stamps.hook = prof.disable  # at the call's first copy (later ones: already off)
            for _ in range(args.calls):
                stamps.clear()
                prof.enable()
                call()
                prof.disable()
            stamps.hook = None
            after = cProfile.Profile()  # from the call's last wait for the GPU to its return
            ends.hook = after.enable
            for _ in range(args.calls):
                stamps.clear()
                call()
                after.disable()
            ends.hook = None
            out["faces"][face] = {
                "to_first_copy_us": spread(to_first), "after_last_sync_us": spread(tail), "call_ms": spread(whole),
                "copies_per_call": len(stamps),
                "before_first_copy_by_own_time": by_own_time(prof, args.calls, args.top),
                "after_last_sync_by_own_time": by_own_time(after, args.calls, args.top)}
            s = out["faces"][face]
            print(f"{face}: first copy after {s['to_first_copy_us']['median']:.1f} us (median; "
                  f"{s['to_first_copy_us']['min']:.1f}-{s['to_first_copy_us']['max']:.1f}), returned "
                  f"{s['after_last_sync_us']['median']:.1f} us after its last sync "
                  f"({s['after_last_sync_us']['min']:.1f}-{s['after_last_sync_us']['max']:.1f}), call "
                  f"{s['call_ms']['median']:.3f} ms", flush=True)
            for part in ("before_first_copy_by_own_time", "after_last_sync_by_own_time"):
                print(f" {part}:", flush=True)
                for r in s[part][:12]:
                    print(f"  {r['own_us_per_call']:8.1f} us own {r['cumulative_us_per_call']:8.1f} cum "
                          f"{r['calls_per_call']:5.1f}x  {r['function']}", flush=True)
    finally:
        restore_sync()
        restore()
        job.close()
        rf.drop_warm_pipelines()
        hb.close()
    write(out, args.out)


if __name__ == "__main__":
    main()
