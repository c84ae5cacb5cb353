"""``ringflow demo``: the main job in under a minute.

Streams a fresh numpy array through ``y = 2x + 1`` (the ``pageable`` workload, small) and the
tutorial's in-place pinned workload (``seed``) against their baselines, then writes a Perfetto
trace and a Gantt PNG of a profiled run. Uses the GPU when one is usable and says when it
falls back to the simulated H200.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

import ringflow as rf

TRACE_FILE, PLOT_FILE = "trace.json", "timeline.png"  # what the demo writes into its folder


def demo(device: "str | None" = None, out_dir: str = "ringflow-demo") -> int:
    """Run the demo on ``device`` (a :func:`ringflow.device` spec; None reads RINGFLOW_DEVICE)
    and write ``trace.json`` and ``timeline.png`` into ``out_dir`` (made if missing).

    Returns:
        0, or 1 when the profiled run's output is wrong.

    Raises:
        TypeError, ValueError, DeviceUnavailableError: as :func:`ringflow.device`.
        OSError: ``out_dir`` cannot be made or written.
    """
    from rich.console import Console
    from rich.markup import escape

    from ._bench import kernels
    from ._bench.measure import fresh_random
    from ._bench.runner import quiet_gc, table
    from ._bench.workloads import inplace_pinned, pageable
    from ._device import SimulatedFallbackWarning, parse_spec
    from ._files import printable
    from ._pipeline.whole_array import stream_map_report

    console = Console()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SimulatedFallbackWarning)  # the demo says so itself, below
        dev = rf.device(device)
    quiet_gc()
    if dev.backend == "sim":
        if parse_spec(device)[0] == "sim":
            why = "As asked, running"
        else:
            # the reason may hold brackets ("pip install 'ringflow[cuda]'"): not rich markup
            why = f"[yellow]No usable GPU ({escape(rf.cuda_available()[1])}).[/] Running"
        console.print(f"{why} on the simulated H200 (profile {dev.profile.name}): times below are virtual, "
                      "from measured H200 figures.")
    else:
        console.print(f"Running on {dev.name}.")
    MiB = 1 << 20
    sim = dev.backend == "sim"
    with console.status("pageable: a fresh numpy array in, a new one out"):
        res = pageable(dev, size_bytes=(32 if sim else 256) * MiB, repeats=3)
    console.print(table(res))
    with console.status("seed: the tutorial's pinned in-place kernel"):
        res = inplace_pinned(dev, name="seed", size_bytes=(32 if sim else 256) * MiB, iters=64, repeats=3,
                             chunk_counts=(8, 32))
    console.print(table(res))
    x = fresh_random((16 if sim else 256) * MiB // 4, seed=7)
    y, rep = stream_map_report(kernels.scale_shift(), x, device=dev, chunk_bytes=(1 if sim else 16) * MiB)
    if not np.array_equal(y, x * np.float32(2) + np.float32(1)):
        console.print("[red]the profiled run's output is wrong[/]")
        return 1
    console.print(rep.table())
    # made only now, with the files to go in it: an interrupted run leaves no empty folders behind
    os.makedirs(out_dir, exist_ok=True)
    trace = rep.save_trace(os.path.join(out_dir, TRACE_FILE))
    png = os.path.join(out_dir, PLOT_FILE)
    try:
        rep.plot(png)
    except RuntimeError as exc:  # matplotlib missing
        png = f"(no PNG: {exc})"
    # a file's name and the reason are text, not rich markup: "a[/b]" failed, "[red]" vanished
    console.print(f"trace: {printable(trace)} (open in ui.perfetto.dev)   timeline: {printable(png)}")
    dev.close()
    return 0
