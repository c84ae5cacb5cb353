"""Peak memory of ``ringflow trace`` on a long run's trace, against reading the same file whole.

Writes a trace of ``--chunks`` chunks with ringflow's own writer, then, each in a fresh process
and ``--repeats`` times: the command (``python -m ringflow trace FILE --json``, which reads the
file as a stream), the same summary from every span read into memory (the reader the command
falls back to for a file the stream cannot take), and the interpreter with ringflow imported and
nothing read (the floor). Reports peak resident memory (``ru_maxrss``) and wall time, medians and
ranges, and the ratios to reading whole, as JSON.

    PYTHONPATH=src python bench/trace_memory.py --chunks 210000 --out bench/results/F.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each prints its own peak resident memory in KiB (Linux's unit for ru_maxrss) as its last line.
_PEAK = "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
WAYS = {
    "stream (ringflow trace)": "import sys, contextlib, io\nfrom ringflow._cli import main\n"
                               "with contextlib.redirect_stdout(io.StringIO()):\n"
                               "    main(['trace', sys.argv[1], '--json'])\n" + _PEAK,
    "read whole": "import sys\nfrom tests.helpers.traces import reference_summary\n"
                  "reference_summary(sys.argv[1])\n" + _PEAK,
    "import only": "import sys\nimport ringflow._cli, ringflow._trace.summary\n" + _PEAK,
}


def run_once(code: str, path: str) -> tuple[float, float]:
    """(peak resident MiB, wall seconds) of ``code`` run in a fresh interpreter on ``path``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "src")]))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    return int(done.stdout.strip().splitlines()[-1]) / 1024, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=210_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "long.json")
        # written by a process of its own: Linux starts a child's peak resident memory at its
        # parent's, so a parent that built the trace would show in every measured child
        run_once(f"import sys\nfrom tests.helpers.traces import write_long_trace\n"
                 f"write_long_trace(sys.argv[1], {args.chunks})\n" + _PEAK, path)
        size = os.path.getsize(path)
        rows = {}
        for _ in range(args.repeats):  # interleaved: a drift of the machine touches every way alike
            for name, code in WAYS.items():
                rows.setdefault(name, []).append(run_once(code, path))
    out = {"date": datetime.date.today().isoformat(), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "environment": {"python": platform.python_version(), "platform": platform.platform()},
           "command": " ".join(["python"] + sys.argv), "trace_bytes": size, "chunks": args.chunks, "ways": {}}
    for name, got in rows.items():
        peaks, walls = [g[0] for g in got], [g[1] for g in got]
        out["ways"][name] = {"peak_mib_median": statistics.median(peaks), "peak_mib_range": [min(peaks), max(peaks)],
                             "wall_s_median": statistics.median(walls), "wall_s_range": [min(walls), max(walls)]}
    ways = out["ways"]
    whole, stream = ways["read whole"], ways["stream (ringflow trace)"]
    out["ratios"] = {"peak_stream_over_whole": stream["peak_mib_median"] / whole["peak_mib_median"],
                     "wall_stream_over_whole": stream["wall_s_median"] / whole["wall_s_median"],
                     "peak_stream_over_file": stream["peak_mib_median"] * (1 << 20) / size,
                     "peak_whole_over_file": whole["peak_mib_median"] * (1 << 20) / size}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
