"""The device protocol's shared behaviour, as every backend inherits it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import pytest

from ringflow._device import protocol
from tests.helpers import unit_device
from tests.helpers.dtypes import DEVICE_DTYPES, NOT_DEVICE_DTYPES, NOT_DEVICE_IDS, refusal
from tests.helpers.interrupts import InterruptAt
from tests.helpers.threads import wait_until_idle


@pytest.mark.parametrize("seconds,error", [(-1.0, ValueError), (math.nan, ValueError), (1e300, ValueError),
                                           ("1", TypeError), (None, TypeError)], ids=repr)
def test_a_real_clock_sleep_checks_seconds_as_the_simulated_one_does(seconds, error):
    """The sleep a real GPU inherits refuses what the simulated GPU's refuses, in the same words."""
    with pytest.raises(error, match=r"sleep\(seconds\) must be a number of seconds"):
        protocol.Device.sleep(unit_device(), seconds)


def test_a_real_clock_sleep_of_zero_returns():
    protocol.Device.sleep(unit_device(), 0)


@pytest.mark.parametrize("dtype", DEVICE_DTYPES + [np.longlong, np.intc, np.ulonglong, "=f4", np.dtype("f4").newbyteorder("=")])
def test_the_dtypes_of_device_arrays_are_taken(dtype):
    protocol.check_device_dtype("x", np.dtype(dtype))


@pytest.mark.parametrize("dtype,advice", NOT_DEVICE_DTYPES, ids=NOT_DEVICE_IDS)
def test_a_dtype_no_gpu_array_holds_is_refused_naming_the_argument_and_what_to_pass(dtype, advice):
    """numpy holds dates, strings, records, raw bytes and long doubles, so the simulated GPU moved
    and computed on them; CuPy, PyTorch and CUDA kernels have no such types, so on a GPU the same
    program failed in the framework, at the first compute. One rule refuses them on both."""
    with pytest.raises(TypeError, match=r"^x: " + refusal(dtype, advice)):
        protocol.check_device_dtype("x", dtype)


@pytest.mark.parametrize("dtype,error,says", [
    (np.dtype(object), TypeError, r"dtype object holds Python objects.*use a numeric dtype"),
    (np.dtype([("a", "f4"), ("b", object)]), TypeError, r"dtype .* holds Python objects"),
    (np.dtype(">f4"), TypeError, r"dtype >f4 is in non-native byte order.*newbyteorder"),
    (np.dtype("V0"), ValueError, r"dtype \|V0 has items of 0 bytes.*such as 'u1'"),
], ids=["object", "object field", "swapped", "V0"])
def test_objects_swapped_bytes_and_empty_items_keep_their_own_words(dtype, error, says):
    with pytest.raises(error, match=r"^x: " + says):
        protocol.check_device_dtype("x", dtype)


@pytest.mark.parametrize("name,bits", [("bfloat16", 16), ("float8_e4m3fn", 8), ("float8_e5m2", 8), ("int4", 8)])
def test_a_numpy_extension_dtype_is_refused_with_how_to_move_its_bits(name, bits):
    """ml_dtypes' types (bfloat16, the float8s, int4) are numpy dtypes of no kind the rule knows
    (bfloat16 reads as raw bytes, float8_e5m2 as a float): PyTorch and CUDA have several of them,
    so the refusal must not say GPUs have no such type, and must say to move the bits as unsigned
    integers and view them back, not to widen them (float64 would take eight times the bytes)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = np.dtype(getattr(ml_dtypes, name))
    with pytest.raises(TypeError) as info:
        protocol.check_device_dtype("x", dtype)
    said = str(info.value)
    assert said.startswith(f"x: dtype {name} (from ml_dtypes) is not one ringflow moves as itself"), said
    assert f"a.view(np.uint{bits})" in said and "torch" in said, said
    assert "no such type" not in said and "astype" not in said, said


@pytest.mark.parametrize("dtype,advice", NOT_DEVICE_DTYPES[:3], ids=NOT_DEVICE_IDS[:3])
def test_a_device_checks_dtypes_by_the_rule_unless_its_backend_narrows_it(dtype, advice):
    device = unit_device()
    with pytest.raises(TypeError, match=r"^items: " + refusal(dtype, advice)):
        protocol.Device.check_dtype(device, "items", dtype)
    for taken in DEVICE_DTYPES:
        protocol.Device.check_dtype(device, "items", np.dtype(taken))


_FORK_COPY = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from ringflow._device.protocol import parallel_copy

    src = np.arange(1 << 24, dtype=np.uint8)
    dst = np.empty_like(src)
    parallel_copy(dst, src, 4)  # starts the Python copy threads
    import threading
    from ringflow._device import protocol
    from tests.helpers.threads import wait_until_idle
    # every thread the pool may have, started: the inherited pool then starts none in the child
    every = threading.Barrier(protocol.MAX_COPY_THREADS)  # the pool's threads and this one
    for _ in range(protocol.MAX_COPY_THREADS - 1):
        protocol._COPY_THREADS.get().submit(every.wait, 10)
    every.wait(10)
    wait_until_idle(protocol._COPY_THREADS.get())  # the child inherits them counted idle
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)  # a hang ends the child, and the parent reports its status
        dst[:] = 0
        parallel_copy(dst, src, 2)  # one part for the pool: one idle thread counted takes it
        parallel_copy(dst, src, 4)
        copying = sum(t.name.startswith("ringflow-copy") for t in threading.enumerate())
        sys.stdout.write(f"child: {bool((dst == src).all())}, copy threads {copying}\\n")
        sys.stdout.flush()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child status", status)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_splits_copies_over_python_threads_of_its_own():
    """Without the native copier the split copy runs on a process-wide pool of Python threads: a
    child forked after a copy inherited the pool without its threads, counted idle, and queued
    its parts to threads that do not exist (its first split copy waited for ever, until the
    caller took to copying the parts nobody had claimed: then it copied them all alone, and the
    queue grew by a task per part that nothing would run). The child starts a pool of its own:
    threads of its own copy."""
    run = subprocess.run([sys.executable, "-c", _FORK_COPY], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RINGFLOW_NATIVE_COPY": "0", "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "child status 0" in run.stdout and "child: True," in run.stdout, run.stdout + run.stderr[-2000:]
    copying = int(run.stdout.split("copy threads ")[1].split()[0])
    assert copying >= 1, run.stdout  # the child's own: the parent's are not in it


def test_ctrl_c_anywhere_in_a_split_copy_leaves_no_part_writing_after_it(monkeypatch):
    """Without the native copier a large copy is split over Python threads: a Ctrl-C while the
    caller handed the parts out or waited for them raised at once, and the parts still queued or
    running went on writing ``dst`` after the copy had raised (into memory its caller may hand
    on: a pinned block taken back). Every part started is done before the interrupt
    propagates, and none starts after it."""
    from ringflow._device import native_copy

    monkeypatch.setattr(native_copy, "_loaded", False)  # as where no compiler works
    caller = threading.current_thread()
    started, ended = [], []

    def copyto(dst, src, **kw):  # the parts copied on the pool's threads are counted
        pooled = threading.current_thread() is not caller
        if pooled:
            started.append(1)
        np.copyto(dst, src, **kw)
        if pooled:
            ended.append(1)

    monkeypatch.setattr(protocol, "np", types.SimpleNamespace(copyto=copyto, uint8=np.uint8,
                                                              ascontiguousarray=np.ascontiguousarray))
    src = np.arange(4 * protocol.SPLIT_COPY_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    names = ("parallel_copy", "run_here", "settle")
    files = ("/ringflow/_device/protocol.py",)
    with InterruptAt(10 ** 9, names, files) as counting:
        protocol.parallel_copy(dst, src, 4)
    assert np.array_equal(dst, src) and counting.seen > 10, counting.seen
    interrupted = 0
    # (the parts the caller copies itself vary from call to call, and its instructions with them)
    for n in range(2 * counting.seen):
        dst[:] = 0
        raised = False
        with InterruptAt(n, names, files) as at:
            try:
                protocol.parallel_copy(dst, src, 4)
            except KeyboardInterrupt:
                raised = True
        assert raised == bool(at.fired), n  # every Ctrl-C is raised, none lost
        interrupted += raised
        after = len(started)
        assert after == len(ended), (n, at.functions[n])  # none still running
        wait_until_idle(protocol._COPY_THREADS.get())
        assert len(started) == after, (n, at.functions[n])  # none started since
        if not at.fired:
            assert np.array_equal(dst, src), n  # the call ran to its end
        protocol.parallel_copy(dst, src, 4)
        assert np.array_equal(dst, src), n
    assert interrupted > 10, interrupted


# -- close callbacks (Device.on_close), shared by every backend ------------------------------------

def _shell_cuda_device(calls: list):
    """A ``CudaDevice`` with nothing behind it (no GPU here): just what its ``close`` touches, each
    part recording the call, so that the CUDA backend's close is run on any machine."""
    from ringflow._device.cuda.device import CudaDevice
    from ringflow._device.cuda.pool import WorkerThreads

    dev = object.__new__(CudaDevice)
    part = types.SimpleNamespace
    dev.index, dev.name, dev._closed = 0, "shell", False
    dev._ensure_current = lambda: None
    dev._cc = part(sync=lambda: calls.append("sync"))
    dev._pools, dev._threads, dev._idle_events, dev._idle_streams = [], WorkerThreads(), [], {}
    dev._pinned_cache = part(clear=lambda: None)
    dev._live = part(open_objects=lambda: [])
    dev._internal_stream = part(close=lambda: calls.append("internal stream"))
    return dev


def _devices(calls: list) -> list:
    return [("sim", unit_device()), ("cuda", _shell_cuda_device(calls))]


@pytest.mark.parametrize("backend", ["sim", "cuda"])
def test_close_callbacks_run_once_in_order_after_the_device_is_closed(backend):
    calls: list = []
    dev = dict(_devices(calls))[backend]
    seen = []
    dev.on_close(lambda d: seen.append(("first", d is dev, d.closed)))
    dev.on_close(lambda d: seen.append(("second", d is dev, d.closed)))
    cancel = dev.on_close(lambda d: seen.append("cancelled"))
    cancel()
    cancel()  # harmless twice
    dev.close()
    assert seen == [("first", True, True), ("second", True, True)]
    dev.close()  # harmless twice, and runs none again
    assert len(seen) == 2
    dev.on_close(lambda d: seen.append("late"))  # on a closed device: at once
    assert seen[-1] == "late"
    if backend == "cuda":
        assert calls == ["sync", "internal stream"]


@pytest.mark.parametrize("backend", ["sim", "cuda"])
def test_a_failing_close_callback_warns_and_neither_stops_the_others_nor_masks_the_callers_error(backend):
    dev = dict(_devices([]))[backend]
    seen = []

    def broken(d):
        raise KeyError("cache gone")

    dev.on_close(broken)
    dev.on_close(lambda d: seen.append("after"))
    with pytest.warns(RuntimeWarning, match="close callback .* failed: KeyError"):
        with pytest.raises(ValueError, match="the caller's"):
            with dev:  # a with-block closes the device as it leaves, through close_quietly
                raise ValueError("the caller's")
    assert seen == ["after"] and dev.closed


def test_on_close_refuses_what_it_cannot_call_and_keeps_nothing_of_the_device():
    import gc
    import weakref

    dev = unit_device()
    with pytest.raises(TypeError, match="on_close needs a callable, got int"):
        dev.on_close(3)
    ran = []
    dev.on_close(ran.append)
    gone = weakref.ref(dev)
    del dev
    gc.collect()
    assert gone() is None and ran == []  # collected unclosed: nothing ran, and nothing kept it


def test_a_close_callback_registered_while_another_thread_closes_runs_exactly_once():
    for _ in range(20):
        dev = unit_device()
        ran = []
        go = threading.Barrier(2)

        def register():
            go.wait()
            dev.on_close(lambda d: ran.append(1))

        t = threading.Thread(target=register)
        t.start()
        go.wait()
        dev.close()
        t.join()
        assert ran == [1]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit], ids=["KeyboardInterrupt", "SystemExit"])
@pytest.mark.parametrize("backend", ["sim", "cuda"])
def test_a_close_callback_that_raises_a_base_exception_still_lets_every_other_callback_run(backend, stop):
    """A Ctrl-C (or SystemExit) in one close callback is raised by close() once the others have
    run: the list is taken as the device closes, so one skipped then would never run."""
    dev = dict(_devices([]))[backend]
    seen = []

    def interrupted(d):
        seen.append("interrupted")
        raise stop()

    dev.on_close(lambda d: seen.append("before"))
    dev.on_close(interrupted)
    dev.on_close(lambda d: seen.append("after"))
    with pytest.raises(stop):
        dev.close()
    assert seen == ["before", "interrupted", "after"] and dev.closed
    dev.close()  # harmless again, and runs none twice
    assert seen == ["before", "interrupted", "after"]


def test_a_ctrl_c_in_a_close_callback_still_drops_the_warm_engines_kept_for_the_device():
    import ringflow as rf
    from ringflow._pipeline.warm import WARM

    dev = unit_device()

    def interrupted(d):
        raise KeyboardInterrupt

    dev.on_close(interrupted)  # registered before the warm cache's own
    rf.stream_map(lambda x, y: np.multiply(x, 2, out=y), np.arange(64.0), device=dev)
    assert any(p.device is dev for p, *_ in WARM._parked.values())
    with pytest.raises(KeyboardInterrupt):
        dev.close()
    assert not any(p.device is dev for p, *_ in WARM._parked.values()), "the cache let go of the closed device"


@pytest.mark.parametrize("backend", ["sim", "cuda"])
def test_a_close_from_a_second_thread_returns_only_once_the_first_ones_callbacks_have_run(backend):
    """Two threads close one device: the one that finds it closing already waits for the close
    callbacks the other is running (so that, say, the warm engines are gone when it returns);
    a callback that closes the device again does not wait for itself."""
    from tests.helpers.threads import JOIN_S, join, stack_names, start

    dev = dict(_devices([]))[backend]
    order = []
    entered, release = threading.Event(), threading.Event()

    def slow(d):
        entered.set()
        release.wait(JOIN_S)
        d.close()  # again, from inside: returns at once
        order.append("callback done")

    def second():
        dev.close()
        order.append("second close returned")

    dev.on_close(slow)
    first = start(dev.close)
    assert entered.wait(JOIN_S)
    other = start(second)
    # let the second close reach its wait (or, returning at once, end): a state seen, not a time
    deadline = threading.Event()
    for _ in range(int(JOIN_S / 0.001)):
        if other.done() or "_run_close_callbacks" in stack_names(other.thread):
            break
        deadline.wait(0.001)
    release.set()
    join([first, other])
    assert order == ["callback done", "second close returned"]


def test_a_ctrl_c_anywhere_in_close_leaves_the_close_callbacks_to_the_next_close():
    """A KeyboardInterrupt at any instruction of the simulated GPU's close: every callback has
    run once the next close() returns, and none twice."""
    n = 0
    while True:
        dev = unit_device()
        ran = []
        dev.on_close(ran.append)
        with InterruptAt(n, ["close", "_run_close_callbacks"],
                         files=("/ringflow/_device/sim/device.py", "/ringflow/_device/protocol.py")) as at:
            try:
                dev.close()
            except KeyboardInterrupt:
                pass
        dev.close()
        assert ran == [dev] and dev.closed, (n, at.functions[n:n + 1])
        if not at.fired:
            break
        n += 1
    assert n > 3
