"""What a stream capture does to a synchronising call made on the capturing thread, on a GPU and
on the simulated GPU side by side: for each call, a fresh capture begins on stream ``a`` (the
CUDA backend captures in thread-local mode), the call is made, and the capture is ended; the
row records whether the call raised (and what) and whether the capture then ended cleanly. The
calls: synchronising another stream that is not capturing, synchronising and querying an event
recorded on it before the capture began, synchronising the whole device, and the same stream
synchronised from another thread. Each capture holds one fill of a device buffer.

    python3 bench/capture_sync_probe.py --device cuda:0 --out FILE
"""

from __future__ import annotations

import argparse
import sys
import threading

from _script import header, write

import ringflow as rf


def _outcome(fn) -> str:
    try:
        value = fn()
    except BaseException as exc:  # noqa: BLE001 - the outcome is what is recorded
        return f"raised {type(exc).__name__}: {str(exc)[:200]}"
    return f"returned {value!r}"


def _in_other_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(_outcome(fn)))
    t.start()
    t.join(30)
    return box[0] if box else "did not return in 30 s"


def probe(spec: str) -> dict:
    dev = rf.device(spec)
    a, b = dev.create_stream(), dev.create_stream()
    buf = dev.allocate(1 << 20)
    before = b.record()
    before.sync()
    calls = {
        "other stream sync": lambda: b.sync(),
        "event from before the capture: sync": lambda: before.sync(),
        "event from before the capture: is_done": lambda: before.is_done,
        # (the simulated GPU's own call; the CUDA backend has no device-wide synchronisation)
        "device synchronize": dev.synchronize if hasattr(dev, "synchronize") else None,
        "other stream sync, from another thread": lambda: _in_other_thread(b.sync),
    }
    rows = {}
    for name, call in calls.items():
        if call is None:
            rows[name] = {"call": "no such call on this backend", "end_capture": None}
            continue
        a.begin_capture()
        a.fill(buf, 7)  # something captured, so that the graph is not empty
        during = _outcome(call)
        ended = _outcome(lambda: a.end_capture())
        if not ended.startswith("returned"):
            _outcome(a.abort_capture)
        rows[name] = {"call": during, "end_capture": ended}
        print(f"{spec:8s} {name:42s} call: {during[:90]:90s} end: {ended[:90]}", flush=True)
    buf.close()
    a.close()
    b.close()
    dev.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = {"gpu": probe(args.device) if args.device != "sim" else None, "sim": probe("sim")}
    write({**header(args.device), "rows": result}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
