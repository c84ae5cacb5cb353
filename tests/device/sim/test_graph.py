"""Graph capture and replay on the simulated GPU (``ringflow._device.sim.graph``): CUDA's capture
rules are kept (and breaking one abandons the capture), a launched callable runs while captured
and never in a replay, a replay moves the data again, its accesses are checked like any others,
and a failure inside it is reported where it happened."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ringflow as rf
from ringflow._errors import CaptureError, HazardError, LaunchError
from tests.helpers.interrupts import call_interrupted_at

N = 256  # float32 per buffer


def setup(seed=0, chaos=True):
    dev = rf.device("sim", seed=seed, chaos=chaos)
    h, d, o = dev.allocate_host(4 * N), dev.allocate(4 * N), dev.allocate_host(4 * N)
    return dev, h, d, o, dev.create_stream(), dev.create_stream()


def double(x):
    x *= 2


def capture_round_trip(a, b, h, d, o, fn=double):
    """h -> d on a, fn on b (joined from a and back), d -> o on a."""
    a.begin_capture()
    a.copy(d, h)
    b.wait(a.record())
    b.launch(fn, d.array(np.float32, N))
    a.wait(b.record())
    a.copy(o, d)
    return a.end_capture()


@pytest.mark.parametrize("seed", range(4))
def test_each_launch_runs_the_captured_work_on_the_data_there_now(seed):
    dev, h, d, o, a, b = setup(seed)
    graph = capture_round_trip(a, b, h, d, o)
    assert dev.ops_completed == 0  # capturing ran nothing
    for call in range(3):
        values = np.random.default_rng(call).uniform(size=N).astype(np.float32)
        h.view(np.float32)[:] = values
        graph.launch(a)
        a.sync()
        assert np.array_equal(o.view(np.float32), values * 2)
    graph.close()
    graph.close()  # harmless twice
    with pytest.raises(RuntimeError, match="closed"):
        graph.launch(a)


def test_a_launch_costs_the_host_one_launch():
    dev, h, d, o, a, b = setup(chaos=False)
    graph = capture_round_trip(a, b, h, d, o)
    t0 = dev.now
    graph.launch(a)
    launched = dev.now - t0
    assert launched == pytest.approx(dev.profile.launch_overhead_s)
    a.sync()
    t0 = dev.now
    a.copy(d, h)
    b.wait(a.record())
    b.launch(double, d.array(np.float32, N))
    a.wait(b.record())
    a.copy(o, d)
    p = dev.profile  # the same calls made one by one: each its own overhead
    assert dev.now - t0 == pytest.approx(2 * p.copy_overhead_s + 4 * p.event_overhead_s + p.launch_overhead_s)


def test_a_missing_wait_inside_the_graph_is_a_hazard_at_launch():
    dev, h, d, o, a, b = setup()
    a.begin_capture()
    before_copy = a.record()
    a.copy(d, h)
    b.wait(before_copy)  # ordered before the copy into d, not after it
    b.launch(double, d.array(np.float32, N))
    a.wait(b.record())
    graph = a.end_capture()
    with pytest.raises(HazardError):
        graph.launch(a)
        a.sync()


def test_the_launch_is_ordered_after_the_launching_stream_only():
    dev, h, d, o, a, b = setup()
    graph = capture_round_trip(a, b, h, d, o)
    other = dev.create_stream()
    other.copy(h, o)  # writes h; nothing orders the graph's read of h after it
    with pytest.raises(HazardError):
        graph.launch(a)
        a.sync()


def test_a_captured_launch_calls_fn_while_capturing_and_never_in_a_launch():
    """As on a GPU, where ``fn`` is host code that enqueues kernels: it runs once, when the
    launch is captured, and each graph launch replays the work it enqueued, on the data in the
    buffers then, with the host values it read while captured (here a counter and a global)."""
    dev, h, d, o, a, b = setup(1)
    calls, scale = [], [3.0]

    def scaled(x):
        calls.append(1)
        x *= scale[0]
        x += len(calls)

    graph = capture_round_trip(a, b, h, d, o, fn=scaled)
    assert len(calls) == 1 and dev.ops_completed == 0  # called while captured; nothing ran
    for call in range(3):
        scale[0] = 5.0 + call  # too late: a launch replays what fn enqueued when captured
        values = np.random.default_rng(call).uniform(size=N).astype(np.float32)
        h.view(np.float32)[:] = values
        graph.launch(a)
        a.sync()
        assert np.array_equal(o.view(np.float32), values * np.float32(3) + np.float32(1))
    assert len(calls) == 1
    graph.close()


def test_fn_reading_device_data_on_the_host_while_captured_abandons_the_capture():
    """A value of the device's data on the host (``float(x.sum())``, ``if x[0] > 0``, ``x.item()``,
    ``np.asarray(x)``) needs the GPU to have run: a synchronisation, which a capture refuses."""
    reads = {
        "if": lambda x: x.__imul__(2) if x.sum() > 0 else None,
        "float": lambda x: x.__imul__(float(x.max())),
        "item": lambda x: x.__iadd__(x[0].item()),
        "asarray": lambda x: np.asarray(x),
        "tolist": lambda x: x.tolist(),
        "print": lambda x: f"{x}",
    }
    for what, fn in reads.items():
        dev, h, d, o, a, b = setup()
        a.begin_capture()
        a.copy(d, h)
        with pytest.raises(CaptureError, match="on the host") as info:
            a.launch(fn, d.array(np.float32, N))
        assert "abandoned" in str(info.value), what
        with pytest.raises(CaptureError, match="abandoned"):
            a.end_capture()
        a.copy(d, h)  # the stream runs work again
        a.sync()


@pytest.mark.parametrize("in_fn", [False, True], ids=["between calls", "inside a launched fn"])
def test_synchronising_the_device_while_a_stream_captures_abandons_the_capture(in_fn):
    """A GPU refuses to synchronise the device while one of its streams captures
    (cudaErrorStreamCaptureUnsupported), from the capturing thread or from a launched
    callable, which is host code there: the simulated GPU abandons the capture, naming why."""
    dev, h, d, o, a, b = setup()
    a.begin_capture()
    a.copy(d, h)
    says = r"capture abandoned: synchronising the device while .* captures"
    with pytest.raises(CaptureError, match=says):
        if in_fn:
            a.launch(lambda x: dev.synchronize(), d.array(np.float32, N))
        else:
            dev.synchronize()
    with pytest.raises(CaptureError, match=says):
        a.end_capture()
    a.copy(d, h)  # the stream runs work again, and the device synchronises
    dev.synchronize()
    assert not dev._captures


def test_synchronising_another_stream_on_the_capturing_thread_abandons_the_capture():
    """A GPU refuses a stream synchronisation from the thread whose capture is in progress, even of
    a stream that is not capturing (thread-local capture: a potentially unsafe call there), and
    the capture is invalidated; from another thread, and an event recorded before the capture,
    may be synchronised: the simulated GPU does the same."""
    dev, h, d, o, a, b = setup()
    b.copy(d, h)
    before = b.record()
    a.begin_capture()
    a.copy(o, d)
    before.sync()  # (recorded before the capture began: allowed)
    assert before.is_done
    with pytest.raises(CaptureError, match=r"capture abandoned: synchronising .* while .* captures on this thread"):
        b.sync()
    with pytest.raises(CaptureError, match="abandoned"):
        a.end_capture()
    a.begin_capture()
    a.copy(o, d)
    errors = []

    def other_thread():
        try:
            b.sync()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert not errors
    graph = a.end_capture()  # the other thread's sync left the capture whole
    graph.launch(a)
    a.sync()


def test_an_exception_from_fn_while_captured_comes_from_the_launch():
    """As on a GPU, where ``fn`` runs when the launch is made: its exception is raised there,
    and the capture goes on (it asked the GPU for nothing wrong)."""
    dev, h, d, o, a, b = setup()

    def bad(x):
        raise ValueError("no")

    a.begin_capture()
    with pytest.raises(ValueError, match="no"):
        a.launch(bad, d.array(np.float32, N))
    a.launch(double, d.array(np.float32, N))
    graph = a.end_capture()
    h.view(np.float32)[:] = 1
    a.copy(d, h)
    graph.launch(a)
    a.copy(o, d)
    a.sync()
    assert (o.view(np.float32) == 2).all()


def _refuse_negatives(x):
    if (x < 0).any():
        raise ValueError("a negative value")
    x *= 2


TRAP = rf.Kernel('extern "C" __global__ void trap(float* x, size_t n) {}', "trap", reference=_refuse_negatives)


def test_a_kernel_failing_on_the_data_inside_a_launch_is_reported_by_its_event_and_the_launching_stream():
    """A kernel's body (an ``rf.Kernel``'s numpy reference) is device code: each launch runs it
    on the data there then, and a failure is reported where it happened."""
    dev, h, d, o, a, b = setup()
    a.begin_capture()
    a.copy(d, h)
    b.wait(a.record())
    b.launch(TRAP, d.array(np.float32, N))
    computed = b.record()
    a.wait(computed)
    graph = a.end_capture()
    assert graph.event(computed) is None  # nothing launched yet
    h.view(np.float32)[:] = 1
    graph.launch(a)
    a.sync()
    assert graph.event(computed).error is None
    h.view(np.float32)[7] = -1
    graph.launch(a)
    with pytest.raises(LaunchError, match="ValueError: a negative value"):
        a.record().sync()
    assert isinstance(graph.event(computed).error.__cause__, ValueError)


def test_capture_rules():
    dev, h, d, o, a, b = setup()
    earlier = b.record()
    a.begin_capture()
    with pytest.raises(CaptureError, match="already"):
        a.begin_capture()
    with pytest.raises(CaptureError, match="recorded outside the capture"):
        a.wait(earlier)
    with pytest.raises(CaptureError, match="abandoned"):
        a.copy(d, h)  # an abandoned capture refuses more work
    with pytest.raises(CaptureError, match="outside the capture"):
        a.end_capture()
    # ended either way: the stream runs work again
    a.copy(d, h)
    a.sync()

    # the pool submitter's host work is not part of the capture either
    pool = dev.create_worker_pool(1)
    a.begin_capture()
    with pytest.raises(CaptureError, match="host work outside the capture"):
        a.wait(pool.host_work(1e-6))
    with pytest.raises(CaptureError, match="outside the capture"):
        a.end_capture()
    pool.close()

    a.begin_capture()
    captured = a.record()
    with pytest.raises(CaptureError, match="querying"):
        assert captured.is_done
    a.abort_capture()
    with pytest.raises(CaptureError, match="finished capture"):
        captured.sync()
    with pytest.raises(CaptureError, match="finished capture"):
        b.wait(captured)

    for forbidden in (lambda: a.sync(), lambda: dev.allocate(64), lambda: a.record(timing=True)):
        a.begin_capture()
        with pytest.raises(CaptureError):
            forbidden()
        with pytest.raises(CaptureError):
            a.end_capture()

    a.begin_capture()
    b.wait(a.record())
    b.launch(double, d.array(np.float32, N))  # b joined and never joined back
    with pytest.raises(CaptureError, match="not joined back"):
        a.end_capture()
    with pytest.raises(CaptureError, match="no capture"):
        b.end_capture()
    a.abort_capture()  # harmless with none in progress
    assert dev.live().streams == 2


def test_an_interrupt_anywhere_in_joining_a_stream_leaves_nothing_capturing_once_aborted():
    """An exception (Ctrl-C under a SIGINT handler of the process's own, say) at any instruction
    of a stream's joining a capture, then the capture aborted, as MapJob(graph=True) aborts
    one its enqueue pass left: no stream captures any more, so the thread may allocate and
    every stream runs work again (a stream left joined refused both for good)."""
    names, files = ("wait", "_wait_captured", "add"), ("/ringflow/_device/sim/",)
    n = 0
    while True:
        dev, h, d, o, a, b = setup(chaos=False)
        a.begin_capture()
        event = a.record()
        hook, _ = call_interrupted_at(n, lambda: b.wait(event), names, files)
        a.abort_capture()
        dev.allocate(64).close()
        b.copy(d, h)
        b.sync()
        if not hook.fired:
            break
        n += 1
    assert n > 3, n


def test_a_launch_interrupted_anywhere_leaves_the_launching_stream_after_what_it_enqueued():
    """A graph's launch is one call, and a GPU runs all of it or none: one stopped by an
    exception (Ctrl-C under a SIGINT handler of the process's own, say) at any instruction after
    some of its work was enqueued on the graph's lanes still has the launching stream wait for
    that work, so that syncing the stream, as a caller cleaning up does, orders it before the
    buffers it touches are freed."""
    names, files = ("launch", "copy", "wait", "record", "_enqueue", "_begin"), ("/ringflow/_device/sim/",)
    n = 0
    while True:
        dev, h, d, o, a, b = setup(seed=n, chaos=False)
        graph = capture_round_trip(a, b, h, d, o)
        hook, _ = call_interrupted_at(n, lambda: graph.launch(a), names, files)
        a.sync()
        for buffer in (h, d, o):
            buffer.close()  # a HazardError here: the lanes' work was not ordered before the free
        graph.close()
        if not hook.fired:
            break
        n += 1
    assert n > 10, n


def test_two_captures_do_not_merge():
    dev, h, d, o, a, b = setup()
    c = dev.create_stream()
    a.begin_capture()
    c.begin_capture()
    with pytest.raises(CaptureError, match="another"):
        c.wait(a.record())
    a.abort_capture()
    c.abort_capture()


def test_graph_lanes_are_counted_and_released():
    dev, h, d, o, a, b = setup()
    graph = capture_round_trip(a, b, h, d, o)
    assert dev.live().streams == 4  # two streams, two lanes
    graph.launch(a)
    a.sync()
    graph.close()
    assert dev.live().streams == 2
