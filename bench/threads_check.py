"""Many threads, one pipeline: N threads each push M random-size float32 requests through ONE
``rf.Pipeline(..., checked=True)`` at the same time, every result compared with numpy bit for
bit. Even-numbered threads ``submit()`` (keeping a few futures outstanding), odd-numbered ones
use ``map()``. With ``--threads 1`` the one client runs on the main thread.

    PYTHONPATH=src python3 bench/threads_check.py --device cuda:0 --threads 8 --requests 10000 --out threads.json

Reports the requests run, wrong results (must be 0), errors, wall time, requests/s, whether
``pipe.stats()`` balances (accepted == delivered + failed + cancelled + in_flight, while the
threads run and after ``close()``, when in_flight must be 0) and the device's live buffers,
streams and events after ``close()`` (must be 0). Exits 1 if any of that is wrong, or if a thread
is still running ``--timeout`` seconds (wall clock) after the start.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import sys
import threading
import time

import numpy as np

import ringflow as rf
from ringflow._bench import kernels

MiB = 1 << 20


def expected(a: np.ndarray) -> np.ndarray:
    return a * np.float32(2) + np.float32(1)


def make_request(rng: np.random.Generator, max_elems: int) -> np.ndarray:
    """A fresh float32 request of 1 .. max_elems elements, values away from zero."""
    n = int(rng.integers(1, max_elems + 1))
    return rng.uniform(0.5, 1.5, n).astype(np.float32)


class Tally:
    """What one thread saw: requests checked, wrong results, errors (the first few kept)."""

    def __init__(self, thread: int, mode: str):
        self.thread, self.mode = thread, mode
        self.checked = self.wrong = self.errors = 0
        self.error_samples: list[str] = []
        self.finished = False

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if len(self.error_samples) < 3:
            self.error_samples.append(f"{type(exc).__name__}: {exc}"[:300])

    def check(self, item: np.ndarray, got) -> None:
        self.checked += 1
        ok = isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == item.shape \
            and np.array_equal(got, expected(item))
        self.wrong += int(not ok)

    def as_dict(self) -> dict:
        return {"thread": self.thread, "mode": self.mode, "checked": self.checked, "wrong": self.wrong,
                "errors": self.errors, "error_samples": self.error_samples, "finished": self.finished}


def submit_thread(pipe: rf.Pipeline, tally: Tally, count: int, max_elems: int, seed: int, window: int) -> None:
    """``count`` submits, up to ``window`` futures outstanding, each result checked oldest first."""
    rng = np.random.default_rng(seed)
    pending: collections.deque = collections.deque()

    def settle_oldest():
        item, fut = pending.popleft()
        try:
            got = fut.result()
        except Exception as exc:  # noqa: BLE001 - counted, the run goes on
            tally.error(exc)
            return
        tally.check(item, got)

    try:
        for _ in range(count):
            item = make_request(rng, max_elems)
            try:
                pending.append((item, pipe.submit(item)))
            except Exception as exc:  # noqa: BLE001
                tally.error(exc)
            while len(pending) > window:
                settle_oldest()
        while pending:
            settle_oldest()
    finally:
        tally.finished = True


def map_thread(pipe: rf.Pipeline, tally: Tally, count: int, max_elems: int, seed: int) -> None:
    """``count`` requests through ``map()`` (ordered), each result checked against its request."""
    rng = np.random.default_rng(seed)
    sent: collections.deque = collections.deque()

    def source():
        for _ in range(count):
            item = make_request(rng, max_elems)
            sent.append(item)
            yield item

    try:
        for got in pipe.map(source()):
            tally.check(sent.popleft(), got)
    except Exception as exc:  # noqa: BLE001 - a failed map ends this thread's stream
        tally.error(exc)
    finally:
        tally.finished = True


def versions() -> dict:
    try:
        from ringflow._doctor import versions as doctor_versions

        return doctor_versions()
    except Exception as exc:  # noqa: BLE001 - versions are informative only
        return {"python": platform.python_version(), "numpy": np.__version__, "ringflow": rf.__version__,
                "error": repr(exc)}


def run(device: str, threads: int, requests: int, max_elems: int, window: int, timeout: float, seed: int) -> dict:
    dev = rf.device(device)
    compute = kernels.scale_shift()  # an rf.Kernel: compiled on a GPU, its numpy reference on the sim
    pipe = rf.Pipeline(compute, device=dev, chunk_bytes=max_elems * 4, checked=True)
    tallies = [Tally(t, "map" if t % 2 else "submit") for t in range(threads)]
    workers = []
    for t, tally in enumerate(tallies):
        if tally.mode == "map":
            target, args = map_thread, (pipe, tally, requests, max_elems, seed + t)
        else:
            target, args = submit_thread, (pipe, tally, requests, max_elems, seed + t, window)
        # daemon: a thread stuck inside the pipeline must not keep the process (and its report) from ending
        workers.append(threading.Thread(target=target, args=args, name=f"client-{t}", daemon=True))
    samples, unbalanced = 0, []
    t0 = time.perf_counter()
    if threads == 1:
        # one client runs on this thread, the one that made the pipeline and closes it: the
        # simulated GPU's checker orders a host thread's accesses only by what that thread observes
        # (events, syncs), so a client thread's last writes would look unordered before close()
        workers[0].run()
    for w in workers if threads > 1 else ():
        w.start()
    deadline = t0 + timeout
    while any(w.is_alive() for w in workers) and time.perf_counter() < deadline:
        # the counters must balance at every moment, not only at the end
        st = pipe.stats()
        samples += 1
        if not st.balanced() and len(unbalanced) < 5:
            unbalanced.append(st.__dict__)
        alive = next((w for w in workers if w.is_alive()), None)  # the last may end since the look above
        if alive is not None:
            alive.join(timeout=0.05)
    wall = time.perf_counter() - t0
    stuck = [w.name for w in workers if w.is_alive()]
    before_close = pipe.stats()
    out = {"threads": threads, "requests_per_thread": requests, "max_elems": max_elems, "window": window,
           "timeout_s": timeout, "wall_s": wall, "stuck_threads": stuck, "per_thread": [t.as_dict() for t in tallies],
           "stats_samples_while_running": samples, "unbalanced_samples": unbalanced,
           "stats_before_close": before_close.__dict__}
    if not stuck:
        close_error = None
        try:
            pipe.close()
        except Exception as exc:  # noqa: BLE001
            close_error = f"{type(exc).__name__}: {exc}"
        after = pipe.stats()
        live = dev.live()
        out.update(stats_after_close=after.__dict__, close_error=close_error, live_after_close=live.__dict__,
                   live_total_after_close=live.total)
    checked = sum(t.checked for t in tallies)
    out.update(requests_total=threads * requests, checked_total=checked, wrong_total=sum(t.wrong for t in tallies),
               errors_total=sum(t.errors for t in tallies),
               requests_per_s=checked / wall if wall > 0 else None)
    after = out.get("stats_after_close", {})
    out["ok"] = bool(not stuck and out["wrong_total"] == 0 and out["errors_total"] == 0
                     and checked == threads * requests and not unbalanced and before_close.balanced()
                     and out.get("close_error") is None and after.get("in_flight") == 0
                     and after.get("accepted") == after.get("delivered") == threads * requests
                     and out.get("live_total_after_close") == 0)
    out["device"] = dev.name
    if not stuck:
        dev.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="sim, cuda:0 or auto")
    ap.add_argument("--threads", type=int, default=8, help="client threads sharing the pipeline")
    ap.add_argument("--requests", type=int, default=10_000, help="requests per thread")
    ap.add_argument("--max-elems", type=int, default=1 << 16, help="largest request, float32 elements")
    ap.add_argument("--window", type=int, default=8, help="futures a submit() thread keeps outstanding")
    ap.add_argument("--timeout", type=float, default=600.0, help="wall-clock seconds before stuck threads fail the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    args = ap.parse_args(argv)
    for name in ("threads", "requests", "max_elems", "window"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.timeout > 0:
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(["python3"] + sys.argv), "host": platform.node(), "host_cpus": os.cpu_count(),
               "versions": versions()}
    summary.update(run(args.device, args.threads, args.requests, args.max_elems, args.window, args.timeout,
                       args.seed))
    summary["machine"] = summary.pop("device")
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(json.dumps({k: v for k, v in summary.items() if k != "per_thread"}, indent=1), flush=True)
    if summary["stuck_threads"]:
        # a stuck thread may hold the pipeline's locks: leave without the interpreter's shutdown joins
        sys.stdout.flush()
        os._exit(1)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
