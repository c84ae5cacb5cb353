"""Hostile use of the newer paths: an interrupt while ``submit`` stages an item or asks for its
output spec, a worker process that dies, results released from other threads while the pipeline
closes. Each must leave a pipeline that goes on (or closes) cleanly, with nothing held."""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest

import ringflow as rf
from tests.helpers import process_prepare as pp


def f(x, y):
    y[...] = x * 2 + 1


def test_an_interrupt_while_submit_stages_an_item_accepts_nothing_and_holds_nothing(monkeypatch):
    dev = rf.device("sim", seed=1)
    with rf.Pipeline(f, device=dev, chunk_bytes=4096) as pipe:
        assert np.array_equal(pipe.submit(np.ones(8, np.float32)).result(), np.full(8, 3, np.float32))
        real = dev.host_copy

        def interrupted(dst, src):
            raise KeyboardInterrupt

        monkeypatch.setattr(dev, "host_copy", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pipe.submit(np.ones(8, np.float32))
        monkeypatch.setattr(dev, "host_copy", real)
        assert pipe.stats().accepted == 1
        gc.collect()
        # nothing held but the pipeline's slab of shared chunks (the first item's result is gone)
        assert rf.host.stats(device=dev).in_use_bytes == pipe.scheduler.space.slab_bytes
        assert np.array_equal(pipe.submit(np.zeros(8, np.float32)).result(), np.ones(8, np.float32))
    gc.collect()
    assert rf.host.stats(device=dev).in_use_bytes == 0


def test_an_interrupt_in_the_output_spec_accepts_nothing():
    calls = []

    def spec(item):
        calls.append(item)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return ((4,), "float32")

    with rf.Pipeline(f, device=rf.device("sim"), chunk_bytes=4096, output=spec) as pipe:
        pipe.submit(np.ones(4, np.float32)).result()
        with pytest.raises(KeyboardInterrupt):
            pipe.submit(np.ones(4, np.float32))
        assert pipe.submit(np.ones(4, np.float32)).result().shape == (4,)
        assert pipe.stats().accepted == 2 and pipe.stats().in_flight == 0


def test_a_worker_process_that_dies_fails_chunks_by_name_and_the_pipeline_still_closes():
    dev = rf.device("sim", seed=2)
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pp.dies_on_3, processes=True, workers=2,
                     on_error="continue") as pipe:
        futs = [pipe.submit(i) for i in range(8)]
        outcomes = [fu.exception() for fu in futs]
    # only the item whose worker died fails (test_processes.py pins the message)
    assert [(i, o.stage) for i, o in enumerate(outcomes) if o is not None] == [(3, "prepare")]
    assert "died (exit code 7)" in str(outcomes[3].__cause__)
    s = pipe.stats()
    assert (s.accepted, s.delivered, s.failed, s.in_flight) == (8, 7, 1, 0)
    assert dev.live().total == 0


@pytest.mark.parametrize("stream", [False, True])
def test_results_released_on_new_threads_after_close_free_their_slots_there(stream):
    """After close, the last release frees the device ring on the releasing thread. That thread
    knows the results' computes completed only through the scheduler's lock, taken after
    close: the checker must see that edge too (a spurious hazard left the ring unfreed)."""
    dev = rf.device("sim", seed=3)
    user = dev.create_stream() if stream else None
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device")
    held = list(pipe.map([np.full(8, k, np.float32) for k in range(3)]))
    go = threading.Event()
    failed = []

    one_at_a_time = threading.Lock()  # catch_warnings is process-wide

    def release(res):
        go.wait()
        with one_at_a_time, warnings.catch_warnings(record=True) as caught:  # a failed free is only a warning
            warnings.simplefilter("always")
            res.release(stream=user)
        failed.extend(str(w.message) for w in caught)

    # each release runs on a thread of its own, after close
    threads = [threading.Thread(target=release, args=(r,)) for r in held]
    for t in threads:
        t.start()
    pipe.close()
    go.set()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads) and failed == []
    if user is not None:
        user.sync()
        user.close()
    del held, threads
    gc.collect()
    assert dev.live().total == 0


def test_results_released_from_other_threads_while_the_pipeline_closes():
    dev = rf.device("sim", seed=3)
    user = dev.create_stream()
    pipe = rf.Pipeline(f, device=dev, chunk_bytes=1024, deliver="device",
                       slots=rf.SlotCounts(host_in=2, device_in=2, device_out=6, host_out=1))
    held = list(pipe.map([np.full(8, k, np.float32) for k in range(5)]))
    start = threading.Barrier(len(held) + 1)

    def release(res):
        start.wait()
        res.release(stream=user)

    threads = [threading.Thread(target=release, args=(r,)) for r in held]
    for t in threads:
        t.start()
    start.wait()
    pipe.close()  # races the releases: each either comes back before close takes them, or after
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    user.sync()
    user.close()
    gc.collect()
    assert dev.live().total == 0
