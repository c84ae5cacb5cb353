"""How the pipeline launches a chunk's compute (:mod:`ringflow._pipeline.stages`)."""

from __future__ import annotations

import numpy as np
import pytest

from ringflow import _plan as plan
from ringflow._pipeline import trees
from ringflow._pipeline.stages import launch_compute
from tests.helpers import Timeline, unit_device

MB = 1_000_000


@pytest.mark.parametrize("form", ["inplace", "inplace-tree", "out-of-place"])
def test_an_uncosted_kernel_takes_on_the_simulated_gpu_what_the_plan_predicts(form):
    """A compute of no declared cost reads its input and writes its result: in place it reads and
    writes each byte of the chunk, as many bytes of device memory as a chunk copied into a
    separate result. The simulated GPU charges the launch what the planner predicts for the chunk
    (``model_stage_times``' compute: ``kernel_seconds`` of its input and result bytes)."""
    dev = unit_device()  # no shortest kernel: the bytes alone set the kernel's time
    tl = Timeline(dev)
    s = dev.create_stream()
    a, b = dev.allocate(MB), dev.allocate(MB)
    x, y = a.array(np.uint8, MB), b.array(np.uint8, MB)

    def f(u, v):
        pass

    if form == "inplace":
        launch_compute(s, f, x, x, inplace=True, sim_seconds=None, index=0)
    elif form == "inplace-tree":
        halves = [a.slice(0, MB // 2).array(np.uint8, MB // 2), a.slice(MB // 2, MB // 2).array(np.uint8, MB // 2)]
        _, tree = trees.flatten((np.empty(1), np.empty(1)))
        launch_compute(s, f, halves, halves, inplace=True, sim_seconds=None, index=0, trees=(tree, tree))
    else:
        launch_compute(s, f, x, y, inplace=False, sim_seconds=None, index=0)
    s.sync()
    (k,) = tl.of("launch")
    predicted = plan.model_stage_times(dev.hardware, MB).compute
    assert predicted == pytest.approx(2 * MB / 10e9)  # read 1 MB + write 1 MB at the unit profile's 10 GB/s
    assert k.done_at - k.started_at == pytest.approx(predicted, rel=1e-12)
