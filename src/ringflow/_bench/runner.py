"""``ringflow bench``: run named workloads, print a table, write JSON (and a trace and PNG)."""

from __future__ import annotations

import datetime
import errno
import gc
import json
import os
import platform
import sys
from typing import Any

import numpy as np

import ringflow as rf

from .. import _jsontext as jsontext
from .._errors import interrupt_behind
from .._files import printable, write_new
from .provenance import provenance
from .workloads import WORKLOADS, run_workload


def result_name(backend: str, when: datetime.datetime, n: int = 1) -> str:
    """The name of the JSON file a run on ``backend`` at ``when`` writes into its ``out_dir``:
    the ``n``-th of that second's runs there (``-2`` and on added after the first)."""
    return f"bench-{backend}-{when.strftime('%Y-%m-%dT%H%M%S')}{'' if n == 1 else f'-{n}'}.json"


RESULTS_PER_SECOND = 999  # the most runs one second's names tell apart in a folder

# the longest of those names (a CUDA run's), which the command line checks its --out folder takes
LONGEST_RESULT_NAME = result_name("cuda", datetime.datetime(2000, 1, 1), RESULTS_PER_SECOND)


def write_new_result(out_dir: str, backend: str, when: datetime.datetime, text: str) -> str:
    """Write ``text`` whole into ``out_dir`` under the first of :func:`result_name`'s names for
    ``when`` that no file holds yet (:func:`ringflow._files.write_new`: the name appears with
    the whole contents), so that runs ending in the same second (two at once into one folder)
    never replace each other's results.

    Returns:
        The path written.

    Raises:
        OSError: the file cannot be written (nothing is left behind), or all the second's names
            are taken (EEXIST).
    """
    names = [os.path.join(out_dir, result_name(backend, when, n)) for n in range(1, RESULTS_PER_SECOND + 1)]
    try:
        return write_new(names, text)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"{RESULTS_PER_SECOND} results of this second are there already",
                              names[0]) from None


def environment(dev) -> dict[str, Any]:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": dev.name, "backend": dev.backend, "python": platform.python_version(),
           "numpy": np.__version__, "ringflow": rf.__version__, "command": " ".join(sys.argv),
           "host_cpus": os.cpu_count(), **provenance()}
    if dev.backend == "cuda":
        try:
            from .._doctor import versions

            env["versions"] = versions()
        except Exception as exc:  # noqa: BLE001 - versions are informative only
            env["versions"] = {"error": repr(exc)}
    return env


def run_bench(device: str = "auto", workloads=WORKLOADS, *, quick: bool = False, out_dir: str | None = None,
              trace: str | None = None, plot: str | None = None, console=None) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = console or Console()
    dev = rf.device(device)
    result: dict[str, Any] = {"environment": environment(dev), "workloads": {}}
    if dev.backend == "cuda":
        try:  # import the baselines' frameworks before anything is timed or frozen
            from . import baselines

            result["environment"]["frameworks"] = baselines.preload_frameworks()
        except Exception:  # noqa: BLE001 - a missing framework only skips baselines
            pass
    result["environment"]["gc"] = quiet_gc()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task("starting", total=None)

        def say(text: str) -> None:
            progress.update(task, description=text)

        for name in workloads:
            say(name)
            gc.collect()
            gc.freeze()  # what the previous workload left behind stays out of the collector's walks
            try:
                result["workloads"][name] = run_workload(dev, name, quick=quick, progress=say)
            except Exception as exc:  # noqa: BLE001 - one failed workload must not hide the others
                interrupt = interrupt_behind(exc)
                if interrupt is not None:  # Ctrl-C inside a simulated launch, reported through its event
                    raise interrupt from None
                result["workloads"][name] = {"workload": name, "error": f"{type(exc).__name__}: {exc}"}
        if trace or plot:
            say("profiled trace of the seed shape")
            _trace_run(dev, trace, plot, quick)
        # written before anything goes to stdout (the progress display's end writes there too):
        # a stdout that cannot take it (| head, a full disk) must not lose the run's results
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            result["path"] = write_new_result(
                out_dir, dev.backend, datetime.datetime.now(datetime.timezone.utc),
                json.dumps(jsontext.plain(result), indent=1, default=_jsonable, allow_nan=False))
    for name, res in result["workloads"].items():
        console.print(table(res))
    if out_dir:
        console.print(f"wrote {printable(result['path'])}")  # (a file's name: text, not rich markup)
    dev.close()
    return result


def quiet_gc() -> dict[str, Any]:
    """Move everything imported so far (torch and CuPy bring millions of objects) out of the
    cyclic collector's reach, as a latency-sensitive service would: otherwise a full collection
    now and then stalls the scheduler thread for as long as it walks that heap. Returns the
    time of one full collection before and after, measured here."""
    import time

    t0 = time.perf_counter()
    gc.collect()
    before = time.perf_counter() - t0
    gc.freeze()
    t0 = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - t0
    return {"full_collection_ms_before_freeze": before * 1e3, "full_collection_ms_after_freeze": after * 1e3,
            "frozen_objects": gc.get_freeze_count()}


def _trace_run(dev, trace, plot, quick) -> None:
    from . import kernels
    from .measure import fresh_random
    from .._pipeline.whole_array import stream_map_report

    x = fresh_random((8 if quick else 64) * (1 << 20) // 4, seed=5)
    _, rep = stream_map_report(kernels.affine(64), x, device=dev, chunk_bytes=(1 << 20) * (1 if quick else 4))
    if trace:
        rep.save_trace(trace)
    if plot:
        rep.plot(plot)


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def table(res: dict[str, Any]):
    from rich.table import Table

    title = res.get("workload", "?")
    for key in ("ideal_ms", "efficiency", "ringflow_ms", "efficiency_no_refill", "vs_cpp_like_with_like",
                "vs_cpp_mapjob_like_with_like",
                "floor_ms", "efficiency_vs_floor", "mapjob_efficiency", "ringflow_vs_torch_ring",
                "ringflow_vs_torch_naive", "p99_80_over_isolated", "p99_80_perfect_fifo_over_isolated",
                "p99_80_over_perfect_fifo", "bound_ms",
                "ringflow_fraction_of_bound", "ringflow_vs_dataloader", "ringflow_processes_fraction_of_bound",
                "ringflow_processes_vs_dataloader"):
        value = res.get(key)
        if isinstance(value, float):
            title += f"  {key}={value:.3f}"
        elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
            title += f"  {key}=" + "/".join(f"{v:.3f}" for v in value)
    t = Table(title=title)
    t.add_column("run")
    t.add_column("median ms", justify="right")
    t.add_column("p10..p90 ms", justify="right")
    t.add_column("ok")
    t.add_column("notes")
    if "error" in res:
        t.add_row("error", "", "", "", res["error"])
        return t
    for row in res.get("rows", []):
        if "skipped" in row:
            t.add_row(row["name"], "-", "-", "-", "skipped: " + row["skipped"][:70])
            continue
        med = row.get("ms_median")
        notes = []
        for k in ("ms_median_no_refill", "efficiency", "ideal_ms", "capacity_per_s", "isolated_p50_ms", "isolated_p99_ms",
                  "load", "p50_ms", "p99_ms", "p99_over_isolated", "p99_slowdown_per_request", "bottleneck",
                  "batches_per_s", "fraction_of_bound", "gpu_idle_fraction", "ms_per_batch", "bound"):
            if k in row:
                v = row[k]
                notes.append(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}")
        if "timing" in row and "chunks" in row:  # a native baseline: its clock and chunk count
            notes.append(f"{row['timing']}, {row['chunks']} chunks")
        if isinstance(row.get("host_clock"), dict):
            hc = row["host_clock"]
            notes.append(f"host clock {hc['ms_median']:.3f} ms ({hc['chunks']} chunks)")
        t.add_row(row["name"], f"{med:.3f}" if med is not None else "-",
                  f"{row['ms_p10']:.3f}..{row['ms_p90']:.3f}" if "ms_p10" in row else "-",
                  {True: "yes", False: "NO"}.get(row.get("correct"), "-"), " ".join(notes))
    return t


