"""The host's time per chunk of each engine, as ringflow doctor --save measures it."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from ringflow import _chunk_host_cost as chunk_host_cost


def test_a_call_costs_once_and_per_chunk_and_only_the_per_chunk_part_is_kept(monkeypatch):
    """Each call costs a fixed part (its engine, its arrays) and a part per chunk; the difference
    of a long and a short call keeps only the latter, whatever the fixed part."""
    clock = [0.0]
    monkeypatch.setattr(chunk_host_cost.time, "perf_counter", lambda: clock[0])

    def run(chunks: int) -> None:
        clock[0] += 0.25 + chunks * 300e-6  # a quarter of a second once, 300 us a chunk

    assert chunk_host_cost._per_chunk(run, 3) == pytest.approx(300e-6)


def test_the_median_of_the_pairs_is_kept_and_a_figure_is_never_below_zero(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(chunk_host_cost.time, "perf_counter", lambda: clock[0])
    per_chunk = iter([None, 1e-4, 1e-4, 9e-4, 9e-4, 2e-4, 2e-4])  # warm-up, then (short, long) pairs

    def run(chunks: int) -> None:
        clock[0] += chunks * (next(per_chunk) or 0.0)

    # pairs of 1e-4, 9e-4, 2e-4 a chunk: the median pair's figure
    assert chunk_host_cost._per_chunk(run, 3) == pytest.approx(2e-4)

    def slower_short_call(chunks: int) -> None:  # the machine stalled the short call
        clock[0] += 1.0 if chunks == chunk_host_cost.SHORT_CHUNKS else 0.5

    assert chunk_host_cost._per_chunk(slower_short_call, 1) > 0


def test_every_engine_is_measured_and_nothing_is_left_on_the_device(monkeypatch):
    """The measurement runs in the user's process when a GPU is calibrated on first use: it keeps
    no engine warm (their streams, events and device memory would stay until the process ends).
    Four figures: the scheduler staging pageable arrays, the scheduler staging a pageable input
    into a ringflow.host result (host="auto" held to staging by a budget under the input's
    bytes), the scheduler on pinned buffers (engine="pipeline") and the direct engine on the
    same buffers."""
    from ringflow import _pipeline

    calls = []
    real = _pipeline.stream_map

    def recorded(f, x, out, **kw):
        calls.append((kw.get("host"), kw.get("engine"), kw.get("x_buffer") is not None, kw.get("keep_warm")))
        return real(f, x, out, **kw)

    monkeypatch.setattr(_pipeline, "stream_map", recorded)
    dev = rf.device("sim")
    try:
        got = chunk_host_cost.chunk_host_seconds(dev, repeats=1)
        live = dev.live()
        assert (live.streams, live.events, live.device_buffers, live.host_buffers) == (0, 0, 0, 0)
        assert live.pooled_host_buffers == 0  # nothing kept in ringflow.host's pool either
    finally:
        dev.close()
    assert set(got) == {"staged", "one_side", "scheduled", "direct"}
    assert all(0 < s < 0.1 for s in got.values()), got
    assert set(calls) == {("stage", None, False, False), ("auto", None, False, False), (None, "pipeline", True, False),
                          (None, "direct", True, False)}


def test_the_one_side_figure_is_timed_with_the_input_alone_staged(monkeypatch):
    """The one-side calls run the scheduler with the input staged and the result used in place
    (the layout's staged sides), and their figure is None where the pool cannot give pinned
    memory (its result would be staged too)."""
    from ringflow._device.host_pool import HostPool
    from tests.helpers.host_strategy import layouts_planned

    seen = layouts_planned(monkeypatch)
    dev = rf.device("sim")
    try:
        chunk_host_cost.chunk_host_seconds(dev, repeats=1)
        assert {layout.staged for layout in seen if layout.strategy == "stage"} == {(True, True), (True, False)}
        monkeypatch.setattr(HostPool, "empty", lambda self, shape, dtype: np.empty(shape, dtype))
        assert chunk_host_cost.chunk_host_seconds(dev, repeats=1)["one_side"] is None
    finally:
        dev.close()


def test_wrong_results_are_an_error_not_a_figure(monkeypatch):
    """A device that copied wrongly must not leave a profile planning with its timings."""
    monkeypatch.setattr(chunk_host_cost, "_copy", lambda x, y: y.fill(0))
    dev = rf.device("sim")
    try:
        with pytest.raises(RuntimeError, match="came back different"):
            chunk_host_cost.chunk_host_seconds(dev, repeats=1)
    finally:
        dev.close()


def test_the_pinned_engines_are_timed_on_pinned_memory_whatever_the_pool_hands_out(monkeypatch):
    """ringflow.host's pool hands out pageable memory once its budget is spent: the direct engine
    could not run on that, and doctor --save failed at its last step; the scheduler's unstaged
    figure is taken on the same pinned buffers."""
    import numpy as np

    from ringflow import _host

    monkeypatch.setattr(_host, "empty", lambda shape, dtype=np.float64, *, device=None: np.empty(shape, dtype))
    dev = rf.device("sim")
    try:
        got = chunk_host_cost.chunk_host_seconds(dev, repeats=1)
        assert got["direct"] > 0 and got["scheduled"] > 0
    finally:
        dev.close()


@pytest.mark.parametrize("repeats", [0, -2])
def test_repeats_below_one_are_refused(repeats):
    with pytest.raises(ValueError, match="repeats must be 1 or more"):
        chunk_host_cost.chunk_host_seconds(None, repeats=repeats)


def test_blocks_the_caller_keeps_in_the_pool_stay_cached():
    """The measurement runs at a device's first use, inside a user's run: blocks the user's
    arrays left cached in ringflow.host's pool stay there (a later array of that size reuses one
    instead of pinning anew)."""
    from ringflow._device import host_pool

    dev = rf.device("sim")
    try:
        pool = host_pool.pool_for(dev)
        kept = pool.empty((1 << 16,), np.float32)
        del kept  # its block goes back to the pool's cache
        cached = pool.stats().cached_bytes
        assert cached > 0
        chunk_host_cost.chunk_host_seconds(dev, repeats=1)
        assert pool.stats().cached_bytes >= cached
    finally:
        dev.close()
