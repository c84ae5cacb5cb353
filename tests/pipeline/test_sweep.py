"""Seeded sweeps: thousands of chunks of random sizes through many ring wrap-arounds on the
chaotic sim with the checker on and released slots poisoned, every output verified."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from ringflow._pipeline.states import RingKind, SlotState
from tests.helpers.pipeline_checks import (
    FAULTS,
    Harness,
    check_result,
    map_skipping_faults,
    random_costs,
    random_sizes,
    run_map,
)

MAX = 64  # int64 elements: 512-byte slots


def wraps(h: Harness, kind: RingKind = RingKind.HOST_IN) -> int:
    ring = next(r for r in h.sched.rings if r.kind is kind)
    taken = sum(1 for k, _, old, _new in h.transitions if k is kind and old is SlotState.FREE)
    return taken // len(ring)


SWEEPS = [
    # (id, chunks, harness options)
    ("ordered-2", 1500, dict(slots=2, workers=2)),
    ("unordered-mixed", 1000, dict(slots=rf.SlotCounts(1, 3, 2, 2), ordered=False, workers=3)),
    ("inplace-3", 800, dict(slots=rf.SlotCounts(3, 2, 0, 1), inplace=True)),
    ("tight-1", 800, dict(slots=1, workers=1)),
    ("unchecked-pipeline", 600, dict(slots=2, checked=False)),
]


@pytest.mark.parametrize("name,chunks,options", SWEEPS, ids=[s[0] for s in SWEEPS])
def test_map_sweep(name, chunks, options):
    seed = sum(map(ord, name))
    h = Harness(seed=seed, chunk_bytes=MAX * 8, **options)
    rng = np.random.default_rng(seed)
    results = run_map(h, random_sizes(rng, chunks, MAX, zero_frac=0.03), costs=random_costs(rng, chunks))
    assert len(results) == chunks
    assert h.pipe.stats() == rf.PipelineStats(chunks, chunks, 0, 0, 0)
    for kind in (RingKind.HOST_IN, RingKind.HOST_OUT):
        assert wraps(h, kind) >= 100  # reuse faults show within a wrap-around: many of them here
    assert h.dev.checks > 6 * chunks  # the happens-before checker looked at every access
    h.check()
    h.close()


def test_submit_sweep_waiting_out_of_order():
    h = Harness(seed=11, slots=rf.SlotCounts(2, 2, 1, 2), chunk_bytes=MAX * 8, max_in_flight=5, workers=2)
    rng = np.random.default_rng(11)
    items = [h.item(k + 1, n, consume_cost=float(rng.choice([0.0, 5e-6, 50e-6])))
             for k, n in enumerate(random_sizes(rng, 1000, MAX))]
    futs = []
    for item in items:
        futs.append(h.pipe.submit(item))  # blocks while 5 are unfinished
        if rng.random() < 0.3:  # now and then wait on a random earlier one
            k = int(rng.integers(len(futs)))
            check_result(futs[k].result(), items[k], k)
            h.check()
    for k in rng.permutation(len(futs)):
        check_result(futs[k].result(), items[k], int(k))
    h.check()
    assert wraps(h) >= 100
    h.close()


def test_sweep_with_faults_and_slow_consumers():
    h = Harness(seed=12, slots=2, chunk_bytes=MAX * 8, on_error="continue", workers=2)
    rng = np.random.default_rng(12)
    items = []
    for k, n in enumerate(random_sizes(rng, 1200, MAX)):
        fault = FAULTS[int(rng.integers(len(FAULTS)))] if rng.random() < 0.1 else None
        items.append(h.item(k + 1, n, fault, consume_cost=float(rng.choice([0.0, 0.0, 30e-6]))))
    good = map_skipping_faults(h, items)
    assert h.pipe.stats() == rf.PipelineStats(len(items), len(good), len(items) - len(good), 0, 0)
    h.check()
    h.close()


def f_affine(x, y):
    y[...] = x * 3 + 1


f_affine.sim_seconds = lambda nbytes: 1e-6 + nbytes / 1e9


@pytest.mark.parametrize("host", ["stage", "register"])
@pytest.mark.parametrize("seed", [0, 1])
def test_stream_map_sweep(host, seed):
    rng = np.random.default_rng(seed)
    n = 1_000_003  # not a multiple of the rows per chunk: a short last chunk
    x = rng.standard_normal(n).astype(np.float32)
    dev = rf.device("sim", seed=seed, chaos=True)
    y = rf.stream_map(f_affine, x, device=dev, chunk_bytes=4000, slots=rf.SlotCounts(2, 2, 2, 2), checked=True,
                      host=host)
    assert np.array_equal(y, x * 3 + 1)  # ~1000 chunks
    import gc
    gc.collect()
    assert dev.live().total == 0


def test_stream_map_sweep_2d_odd_rows():
    rng = np.random.default_rng(5)
    x = rng.integers(-1000, 1000, (30011, 7), dtype=np.int16)
    dev = rf.device("sim", seed=5, chaos=True)
    y = rf.stream_map(f_affine, x, device=dev, chunk_bytes=7 * 2 * 31, slots=1, checked=True, host="stage")
    assert np.array_equal(y, x * 3 + 1)  # ~970 chunks of 31 rows
