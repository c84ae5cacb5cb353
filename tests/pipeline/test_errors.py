"""Stage errors reach the caller once as StageError; sticky device errors break the pipeline;
no error path frees a slot before its fences complete (the sim's checker and the harness's
release check both watch every run)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ringflow as rf
from ringflow._errors import DeviceError, StageError
from ringflow._pipeline.states import SlotState
from tests.helpers.gpu_like import sticky_events_as_on_a_gpu
from tests.helpers.pipeline_checks import (
    FAULTS,
    Harness,
    MarkedFault,
    check_result,
    check_stage_error,
    future_outcome,
    map_skipping_faults,
)

N, BAD = 12, 5  # items per run; the index of the faulty one


def run_items(h: Harness, fault: str, bad: int = BAD, n: int = N, size: int = 40):
    return [h.item(k + 1, size, fault if k == bad else None) for k in range(n)]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("slots", [1, 2])
def test_map_raise_reports_once_and_cancels_the_rest(fault, slots):
    h = Harness(seed=slots, slots=slots, chunk_bytes=512, on_error="raise")
    items = run_items(h, fault)
    gen = h.pipe.map(items)
    got = []
    with pytest.raises(StageError) as info:
        for value in gen:
            got.append(value)
    err = info.value
    check_stage_error(err, items[BAD], BAD)
    assert len(got) <= BAD
    for value, item in zip(got, items):
        check_result(value, item)
    with pytest.raises(StopIteration):  # raised once; the map is over
        next(gen)
    assert h.pipe.failures == [err]
    s = h.pipe.stats()
    assert s.failed == 1 and s.in_flight == 0 and s.balanced()
    assert s.delivered + s.cancelled + s.failed == s.accepted
    h.check()
    # after the error the pipeline takes no more work; the message says so
    with pytest.raises(RuntimeError, match="no longer accepts work"):
        h.pipe.submit(h.item(999, 3))
    del info, err, gen  # their tracebacks hold chunks (and so events) alive
    h.close()


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("ordered", [True, False])
def test_map_continue_delivers_the_others(fault, ordered):
    h = Harness(seed=3, slots=2, chunk_bytes=512, on_error="continue", ordered=ordered)
    items = run_items(h, fault)
    got = list(h.pipe.map(items))
    good = [it for k, it in enumerate(items) if k != BAD]
    if ordered:
        assert [v.tag for v in got] == [it.tag for it in good]
    assert sorted(v.tag for v in got) == [it.tag for it in good]
    for value in got:
        check_result(value, h.items[value.tag])
    (err,) = h.pipe.failures
    check_stage_error(err, items[BAD], BAD)
    assert h.pipe.stats() == rf.PipelineStats(N, N - 1, 1, 0, 0)
    h.check()
    del err
    h.close()


@pytest.mark.parametrize("fault", FAULTS)
def test_submit_raise(fault):
    h = Harness(seed=4, slots=1, chunk_bytes=512, on_error="raise")
    items = run_items(h, fault)
    futs = []
    for item in items:
        try:
            futs.append(h.pipe.submit(item))
        except RuntimeError as exc:  # the failure was seen while this submit waited for capacity
            assert "no longer accepts work" in str(exc)
            break
    assert len(futs) > BAD
    with pytest.raises(StageError) as info:
        futs[BAD].result()
    check_stage_error(info.value, items[BAD], BAD)
    assert info.value is futs[BAD].exception()
    for f in futs:  # the error cancelled the rest; enqueued ones end once their events complete
        try:
            f.result()
        except (StageError, concurrent.futures.CancelledError):
            pass
    outcomes = [future_outcome(f)[0] for f in futs]
    for k, (f, o) in enumerate(zip(futs, outcomes)):
        if k == BAD:
            continue
        assert o in ("value", "cancelled"), (k, o)
        if o == "value":
            check_result(f.result(), items[k], k)
        else:
            with pytest.raises(concurrent.futures.CancelledError):
                f.result()
    assert outcomes.count("error") == 1 and h.pipe.failures == [info.value]
    h.check()
    del info, futs
    h.close()


@pytest.mark.parametrize("fault", FAULTS)
def test_submit_continue(fault):
    h = Harness(seed=5, slots=rf.SlotCounts(1, 2, 1, 1), chunk_bytes=512, on_error="continue")
    items = run_items(h, fault)
    futs = [h.pipe.submit(item) for item in items]
    for k, (f, item) in enumerate(zip(futs, items)):
        if k == BAD:
            with pytest.raises(StageError) as info:
                f.result()
            check_stage_error(info.value, item, k)
        else:
            check_result(f.result(), item, k)
    assert h.pipe.stats() == rf.PipelineStats(N, N - 1, 1, 0, 0)
    h.check()
    del info, futs, f
    h.close()


def test_error_messages_name_stage_index_and_sizes():
    h = Harness(seed=6, slots=1, chunk_bytes=512, on_error="continue")
    items = [h.item(1, 10, "oversize"), h.item(2, 10, "badshape"), h.item(3, 10, "prepare")]
    futs = [h.pipe.submit(it) for it in items]
    errs = [f.exception() for f in futs]
    assert [(e.stage, e.index) for e in errs] == [("prepare", 0), ("compute", 1), ("prepare", 2)]
    assert str(errs[0]).startswith("stage 'prepare' failed for chunk 0: ValueError")
    assert "520 bytes" in str(errs[0].__cause__) and "512 bytes" in str(errs[0].__cause__)
    assert "chunk_bytes" in str(errs[0].__cause__)
    assert isinstance(errs[1].__cause__, ValueError)  # the broadcast error f raised
    assert isinstance(errs[2].__cause__, MarkedFault)
    del errs, futs
    h.close()


def test_stage_prepare_that_overflows_a_slot_is_a_prepare_error():
    # a stage prepare (as whole-array jobs use) that reports more bytes than the slot holds
    def prepare(item, raw):
        return (raw.nbytes // 4 + 1,), np.float32

    pipe = rf.Pipeline._for_whole_array(lambda x, y: None, prepare=prepare, consume=lambda i, item, v: None,
                                        item_nbytes=lambda item: 0, host_in_buffer=None, host_out_buffer=None,
                                        max_chunks=4, device=rf.device("sim"), chunk_bytes=256, slots=1,
                                        on_error="continue")
    err = pipe.submit(object()).exception()
    assert isinstance(err, StageError) and err.stage == "prepare"
    assert isinstance(err.__cause__, ValueError)
    assert "260 bytes" in str(err.__cause__) and "256" in str(err.__cause__) and "chunk_bytes" in str(err.__cause__)
    pipe.close()


@pytest.mark.parametrize("write", [
    lambda x, y: y.__setitem__(Ellipsis, np.zeros(x.shape[0] + 3)),  # wrong shape
    lambda x, y: y.__setitem__(Ellipsis, np.array(["not a number"] * x.shape[0])),  # wrong dtype
    lambda x, y: y.__setitem__(Ellipsis, np.zeros((x.shape[0], 2))),  # wrong rank
], ids=["shape", "dtype", "rank"])
def test_wrong_output_written_by_f(write):
    dev = rf.device("sim", seed=1, chaos=True)
    pipe = rf.Pipeline(write, device=dev, chunk_bytes=1024, slots=1, checked=True)
    futs = [pipe.submit(np.arange(10, dtype=np.float32)) for _ in range(3)]
    for f in futs:
        try:
            f.result()
        except (StageError, concurrent.futures.CancelledError):
            pass
    outcomes = [future_outcome(f) for f in futs]
    # every chunk's f fails; the first failure the host sees ends its chunk FAILED and (with
    # on_error="raise") cancels the others still in flight
    errors = [v for k, v in outcomes if k == "error"]
    assert len(errors) >= 1 and all(k in ("error", "cancelled") for k, _ in outcomes)
    for err in errors:
        assert isinstance(err, StageError) and err.stage == "compute"
        assert isinstance(err.__cause__, (ValueError, TypeError))
    assert pipe.failures == errors
    assert pipe.stats().in_flight == 0 and pipe.stats().balanced()
    pipe.close()
    assert dev.live().streams == 0


def test_prepare_must_return_an_array():
    pipe = rf.Pipeline(lambda x, y: None, device=rf.device("sim"), chunk_bytes=256, slots=1,
                       prepare=lambda item: [1, 2, 3], on_error="continue")
    err = pipe.submit("anything").exception()
    assert err.stage == "prepare" and isinstance(err.__cause__, TypeError) and "numpy array" in str(err.__cause__)
    pipe.close()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("slots", [1, rf.SlotCounts(1, 2, 1, 2)], ids=str)
def test_many_faults_in_flight_release_nothing_early(seed, slots):
    # every third item fails somewhere; with tight rings and chaos the failing chunks drain
    # while their neighbours reuse the same slots. The sim's checker raises on any slot reused
    # before its last operation, the harness on any slot freed before its fences
    rng = np.random.default_rng(seed)
    h = Harness(seed=seed, slots=slots, chunk_bytes=512, on_error="continue", workers=2)
    items = []
    for k in range(60):
        fault = FAULTS[int(rng.integers(len(FAULTS)))] if k % 3 == 0 else None
        items.append(h.item(k + 1, int(rng.integers(0, 64)), fault, consume_cost=float(rng.choice([0, 20e-6]))))
    map_skipping_faults(h, items)
    h.check()
    h.close()


# -- sticky device errors ------------------------------------------------------------------------
@pytest.mark.parametrize("after_steps", [0, 1, 3, 8, 20, 60])
def test_sticky_error_breaks_the_pipeline(after_steps):
    h = Harness(seed=after_steps, slots=2, chunk_bytes=512)
    items = [h.item(k + 1, 30) for k in range(10)]
    futs = [h.pipe.submit(it, timeout=0) for it in items[:6]]
    for _ in range(after_steps):
        h.pipe._step()
        h.check()
    pending = [f for f in futs if not f.done()]
    h.dev.inject_sticky_error()
    if pending:
        with pytest.raises(DeviceError, match="sticky device error.*unusable") as info:
            for f in futs:
                f.result()
        assert info.value.sticky
        del info
    h.check()
    s = h.pipe.stats()
    assert s.in_flight == 0 and s.balanced() and s.accepted == 6
    for f in futs:  # chunks delivered before the break keep their results; the rest failed
        kind, value = future_outcome(f)
        assert kind in ("value", "error")
        if kind == "error":
            assert value is h.sched.broken
    # the pipeline learns of the dead context at its next device call: either this submit or
    # the accepted chunk says so
    with pytest.raises(DeviceError, match="sticky device error"):
        h.pipe.submit(items[7]).result()
    assert h.sched.broken is not None and h.pipe.stats().in_flight == 0
    with pytest.raises(DeviceError, match="sticky device error"):
        h.pipe.submit(items[8])
    del futs, f, value, pending
    h.pipe.cancel()
    h.pipe.cancel()
    h.close()
    h.pipe.close()


@pytest.mark.parametrize("slots", [2, rf.SlotCounts(1, 2, 1, 2)], ids=str)
@pytest.mark.parametrize("after_steps", [0, 3, 5, 8, 12, 20])
def test_sticky_error_breaks_the_pipeline_where_events_report_it_done(monkeypatch, after_steps, slots):
    """On a GPU a query of an event after the context broke counts it done, the sticky error as
    its ``error`` (the CUDA backend's events), though the work before it never ran; the simulated
    GPU raises from the query. Either way the pipeline must break: every chunk not yet delivered
    fails with the sticky error, none is delivered from a copy that never ran, and no chunk fails
    as if its own compute had. Emulated here (tests/helpers/gpu_like.py)."""
    sticky_events_as_on_a_gpu(monkeypatch)
    h = Harness(seed=after_steps, slots=slots, chunk_bytes=512)
    items = [h.item(k + 1, 30) for k in range(6)]
    futs = [h.pipe.submit(it, timeout=0) for it in items]
    for _ in range(after_steps):
        h.pipe._step()
    h.dev.inject_sticky_error()
    for f in futs:
        with contextlib.suppress(DeviceError):
            f.result()
    assert h.sched.broken is not None
    h.check()  # every delivered chunk's payload is right
    for f in futs:
        kind, value = future_outcome(f)
        assert kind == "value" or value is h.sched.broken, value
    s = h.pipe.stats()
    assert s.in_flight == 0 and s.balanced()
    del futs, f, value
    h.close()


PIPELINE_AFTER_STICKY = textwrap.dedent(r'''
    import os, sys
    import numpy as np, ringflow as rf
    from ringflow._errors import DeviceError
    from ringflow._kernel import Kernel
    kernel = Kernel(r"""extern "C" __global__ void add_one(const unsigned* x, unsigned* y, size_t n) {
        size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
        if (i >= n) return;
        if (x[i] == 0xDEADu) { unsigned* p = (unsigned*)0x10; *p = 1u; }
        y[i] = x[i] + 1u; }""", "add_one")
    dev = rf.device("cuda:0", array="dlpack")
    pipe = rf.Pipeline(kernel, device=dev, chunk_bytes=1 << 16, on_error="continue")
    items = [np.full(1 << 14, 10 * j, np.uint32) for j in range(16)]
    items[6][5] = 0xDEAD
    futs = []
    for it in items:
        try:
            futs.append(pipe.submit(it))
        except DeviceError as exc:  # refused once the pipeline has broken
            futs.append(exc)
    for j, f in enumerate(futs):
        try:
            if isinstance(f, DeviceError):
                raise f
            print("VALUE", j, bool(np.array_equal(f.result(timeout=60), items[j] + 1)))
        except DeviceError as exc:
            print("STICKY", j, exc.sticky)
        except Exception as exc:
            print("OTHER", j, type(exc).__name__, exc)
    sys.stdout.flush()
    os._exit(0)  # the context is dead: no clean-up at exit
''')


@pytest.mark.gpu
def test_sticky_error_breaks_the_pipeline_on_a_gpu():
    """The case above on a GPU, in a child process (a kernel's illegal address breaks the
    context): each item is delivered right or fails with the sticky DeviceError, the faulting
    one among those that fail (or is refused with it at submit, once the pipeline has broken);
    none fails as a StageError of its own compute."""
    out = subprocess.run([sys.executable, "-c", PIPELINE_AFTER_STICKY], capture_output=True, text=True, timeout=180)
    lines = out.stdout.splitlines()
    assert len(lines) == 16, out.stdout + out.stderr
    assert all(line.endswith(" True") and line.split()[0] in ("VALUE", "STICKY") for line in lines), out.stdout
    assert "STICKY 6 True" in lines, out.stdout


@pytest.mark.parametrize("after_steps", range(0, 40, 3))
def test_cancel_on_a_dead_device_returns_with_nothing_in_flight(after_steps):
    # the device breaks unnoticed; cancel() then poisons a drained device slot, the first call
    # to hit the dead context. It used to raise the DeviceError out of cancel() with chunks
    # still in flight; now it breaks the pipeline as step() would and returns with none
    h = Harness(seed=1, slots=2, chunk_bytes=512, checked=True)
    futs = [h.pipe.submit(h.item(k + 1, 30), timeout=0) for k in range(6)]
    for _ in range(after_steps):
        h.pipe._step()
    h.dev.inject_sticky_error()
    h.pipe.cancel()
    s = h.pipe.stats()
    assert s.in_flight == 0 and s.balanced()
    assert all(slot.state is SlotState.FREE for ring in h.sched.rings for slot in ring.slots)
    assert all(f.done() for f in futs)
    h.check()
    del futs
    h.close()


def test_continue_map_skips_its_own_failures_after_the_device_broke():
    # a chunk failed in prepare (on_error="continue": the map skips it); then the device breaks
    # before the map reaches it. The map used to raise that chunk's StageError because the
    # pipeline was broken; it must skip it and report the broken device instead
    h = Harness(seed=2, slots=2, chunk_bytes=512, on_error="continue")
    items = [h.item(1, 10, consume_cost=1e-3), h.item(2, 10, "prepare"), h.item(3, 10, consume_cost=5e-3)]
    gen = h.pipe.map(items)
    check_result(next(gen), items[0])
    assert h.chunks[1].state is rf.ChunkState.FAILED and not h.chunks[2].state.final
    h.dev.inject_sticky_error()
    h.pipe._step()  # the pipeline notices the dead context (polling chunk 2's consumer)
    assert h.sched.broken is not None
    with pytest.raises(DeviceError, match="sticky device error"):
        next(gen)
    assert [type(e) for e in h.pipe.failures] == [StageError]
    del gen
    h.close()


def test_sticky_error_under_map():
    h = Harness(seed=1, slots=1, chunk_bytes=512)
    items = [h.item(k + 1, 30) for k in range(10)]
    gen = h.pipe.map(items)
    first = next(gen)
    check_result(first, items[0])
    h.dev.inject_sticky_error()
    with pytest.raises(DeviceError, match="sticky device error"):
        list(gen)
    s = h.pipe.stats()
    assert s.in_flight == 0 and s.balanced() and s.failed >= 1
    assert all(c.state in (rf.ChunkState.DELIVERED, rf.ChunkState.FAILED) for c in h.chunks.values())
    h.close()


@pytest.mark.parametrize("n_devices", [1, 2])
def test_work_offered_after_a_failure_stopped_the_pipeline_is_refused_naming_that_failure(n_devices):
    """Not "closed or cancelled": the caller did neither. The refusal names the failure and both
    ways on (a new Pipeline, or on_error='continue')."""
    import asyncio

    def broken(x, y):
        raise ValueError("bad input")

    devs = [rf.device("sim", seed=k) for k in range(n_devices)]
    with rf.Pipeline(broken, device=devs if n_devices > 1 else devs[0], chunk_bytes=1024) as pipe:
        with pytest.raises(StageError, match="bad input"):
            pipe.submit(np.ones(10, np.float32)).result()
        if n_devices > 1:  # the other device stops too once the failure is seen
            pipe.cancel()
        for call in (lambda: pipe.submit(np.ones(10, np.float32)),
                     lambda: list(pipe.map([np.ones(10, np.float32)])),
                     lambda: asyncio.run(pipe.asubmit(np.ones(10, np.float32)))):
            with pytest.raises(RuntimeError, match=r"a failure stopped it.*ValueError: bad input.*on_error='continue'"):
                call()
