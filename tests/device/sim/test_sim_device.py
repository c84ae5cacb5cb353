"""The simulated GPU through the device API: every hazard the issue lists is caught with both
accesses named, every correctly ordered variant passes, plus leaks, sticky and launch errors,
and host worker pools."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import ringflow as rf
from ringflow._device.protocol import Capabilities, LiveCounts
from tests.helpers import small_memory_device, unit_device
from tests.helpers.threads import bounded, run_all

N = 256  # float32 items per buffer
NB = N * 4


@pytest.fixture
def dev():
    return unit_device()


@pytest.fixture
def x():
    return np.random.default_rng(0).standard_normal(N).astype(np.float32)


def double(a, b):
    b[:] = a * 2


def hazard(*parts: str):
    """pytest.raises(HazardError) whose message names every one of ``parts``."""
    return _Hazard(parts)


class _Hazard:
    def __init__(self, parts):
        self.parts = parts
        self.ctx = pytest.raises(rf.HazardError)

    def __enter__(self):
        self.info = self.ctx.__enter__()
        return self.info

    def __exit__(self, *exc):
        ok = self.ctx.__exit__(*exc)
        msg = str(self.info.value)
        for part in self.parts:
            assert part in msg, f"{part!r} not in the HazardError message: {msg}"
        err = self.info.value
        assert err.first is not None and err.second is not None
        assert err.first.op in msg and err.second.op in msg
        return ok


class Chain:
    """Buffers for one copy -> compute -> copy pass."""

    def __init__(self, dev, x=None):
        self.dev = dev
        self.hin, self.hout = dev.allocate_host(NB), dev.allocate_host(NB)
        self.din, self.dout = dev.allocate(NB), dev.allocate(NB)
        if x is not None:
            self.hin.view(np.float32, access="w")[:] = x

    def launch(self, s):
        s.launch(double, self.din.array(np.float32, N), self.dout.array(np.float32, N), reads=[self.din],
                 writes=[self.dout])

    def enqueue_pass(self, s):
        """The whole pass on stream ``s``: copy in, compute, copy out (enqueued, not waited for)."""
        s.copy(self.din, self.hin)
        self.launch(s)
        s.copy(self.hout, self.dout)


def test_each_buffer_names_the_device_that_made_it(dev):
    """``owner``: the only device whose streams may use the buffer (what a call checks its
    pinned-buffer arguments against)."""
    other = unit_device()
    registered = np.zeros(16, np.float32)
    bufs = [dev.allocate_host(8), dev.register_host(registered), dev.allocate(8), other.allocate_host(8)]
    assert [b.owner for b in bufs] == [dev, dev, dev, other] and bufs[0].owner is dev and bufs[3].owner is other
    for b in bufs:
        b.close()


# -- the correct chain, and each hazard of the issue ---------------------------------------------------------------
def test_three_stream_chain_round_trips_bit_exact(dev, x):
    c = Chain(dev, x)
    s1, s2, s3 = dev.create_stream(), dev.create_stream(), dev.create_stream()
    s1.copy(c.din, c.hin)
    e1 = s1.record()
    s2.wait(e1)
    c.launch(s2)
    e2 = s2.record()
    s3.wait(e2)
    s3.copy(c.hout, c.dout)
    e3 = s3.record()
    e3.sync()
    assert np.array_equal(c.hout.view(np.float32, access="r"), x * 2)
    assert dev.checks > 0


def test_host_reads_a_d2h_destination_before_syncing(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    c.enqueue_pass(s)
    e = s.record()
    with hazard("copy d2h", "host view (r)", c.hout.label, f"[0, {NB})", "host thread"):
        c.hout.view(np.float32, access="r")
    e.sync()
    assert np.array_equal(c.hout.view(np.float32, access="r"), x * 2)


def test_host_overwrites_a_pinned_source_before_its_h2d_completed(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    s.copy(c.din, c.hin)
    e = s.record()
    with hazard("copy h2d", "host view (w)", c.hin.label):
        c.hin.view(np.float32, access="w")
    c.hin.view(np.float32, access="r")  # reading it meanwhile is fine: both only read
    e.sync()
    c.hin.view(np.float32, access="w")[:] = 0  # after the sync it is the host's again


def test_read_after_write_on_two_streams(dev, x):
    c = Chain(dev, x)
    s1, s2 = dev.create_stream(), dev.create_stream()
    s1.copy(c.din, c.hin)
    with hazard("copy h2d", "launch double", c.din.label):
        c.launch(s2)


def test_write_after_read_on_two_streams(dev, x):
    # reusing device-in for the next chunk while a kernel on another stream still reads it
    c = Chain(dev, x)
    s1, s2 = dev.create_stream(), dev.create_stream()
    s1.copy(c.din, c.hin)
    s2.wait(s1.record())
    c.launch(s2)
    with hazard("launch double", "copy h2d", c.din.label, "read of", "write of"):
        s1.copy(c.din, c.hin)


def test_write_after_write_on_two_streams(dev, x):
    c = Chain(dev, x)
    s1, s2 = dev.create_stream(), dev.create_stream()
    s1.copy(c.din, c.hin)
    with hazard("copy h2d", "fill", c.din.label):
        s2.fill(c.din, 0)


def test_the_expired_record(dev, x):
    # the event was recorded before the copy it is meant to order
    c = Chain(dev, x)
    s1, s2 = dev.create_stream(), dev.create_stream()
    early = s1.record()
    s1.copy(c.din, c.hin)
    s2.wait(early)
    with hazard("copy h2d", "launch double"):
        c.launch(s2)


def test_a_chain_through_several_streams_orders_the_ends(dev, x):
    c = Chain(dev, x)
    streams = [dev.create_stream() for _ in range(6)]
    streams[0].copy(c.din, c.hin)
    for a, b in zip(streams, streams[1:]):
        b.wait(a.record())
    c.launch(streams[-1])
    streams[-1].sync()


def test_a_chain_missing_one_link_is_caught(dev, x):
    c = Chain(dev, x)
    streams = [dev.create_stream() for _ in range(6)]
    streams[0].copy(c.din, c.hin)
    for i, (a, b) in enumerate(zip(streams, streams[1:])):
        if i != 2:
            b.wait(a.record())
    with hazard("copy h2d", "launch double"):
        c.launch(streams[-1])


@pytest.mark.parametrize("wait_left,wait_right", [(True, True), (True, False), (False, True)])
def test_diamond(dev, wait_left, wait_right):
    # top copies in; left and right each transform one half; bottom copies the whole buffer out
    h = dev.allocate_host(NB)
    h.view(np.float32, access="w")[:] = 1
    d, hout = dev.allocate(NB), dev.allocate_host(NB)
    top, left, right, bottom = (dev.create_stream() for _ in range(4))
    top.copy(d, h)
    e = top.record()
    left.wait(e)
    right.wait(e)
    half = N // 2
    left.launch(lambda a: a.__imul__(3), d.array(np.float32, half))
    right.launch(lambda a: a.__iadd__(5), d.slice(half * 4).array(np.float32, half))
    el, er = left.record(), right.record()
    if wait_left:
        bottom.wait(el)
    if wait_right:
        bottom.wait(er)
    if wait_left and wait_right:
        bottom.copy(hout, d)
        bottom.sync()
        out = hout.view(np.float32, access="r")
        assert (out[:half] == 3).all() and (out[half:] == 6).all()
    else:
        with hazard("launch <lambda>", "copy d2h"):
            bottom.copy(hout, d)


def test_disjoint_halves_on_two_streams_do_not_conflict(dev):
    d = dev.allocate(NB)
    s1, s2 = dev.create_stream(), dev.create_stream()
    s1.fill(d.slice(0, NB // 2), 1)
    s2.fill(d.slice(NB // 2), 2)
    s1.sync()
    s2.sync()


def test_read_read_on_two_streams_is_fine(dev, x):
    c = Chain(dev, x)
    s0, s1, s2 = dev.create_stream(), dev.create_stream(), dev.create_stream()
    s0.copy(c.din, c.hin)
    e = s0.record()
    s1.wait(e)
    s2.wait(e)
    o1, o2 = dev.allocate_host(NB), dev.allocate_host(NB)
    s1.copy(o1, c.din)
    s2.copy(o2, c.din)
    s1.sync()
    s2.sync()


# -- releases -------------------------------------------------------------------------------------------------------
def _pending_read_of_din(dev, x, s):
    c = Chain(dev, x)
    s.copy(c.din, c.hin)
    s.sync()  # device-in is written and the host knows it; only the kernel's read is pending
    c.launch(s)
    return c


def test_closing_a_device_buffer_a_pending_kernel_reads(dev, x):
    s = dev.create_stream()
    c = _pending_read_of_din(dev, x, s)
    e = s.record()
    with hazard("launch double", "device buffer free", c.din.label, "release of"):
        c.din.close()
    assert not c.din.closed and dev.live().device_buffers == 2  # a refused free frees nothing
    e.sync()
    c.din.close()
    assert c.din.closed and dev.live().device_buffers == 1


def test_closing_a_device_buffer_a_pending_copy_writes(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    s.copy(c.din, c.hin)
    with hazard("copy h2d", "device buffer free", "write of", "release of"):
        c.din.close()


def test_stream_ordered_free_on_the_stream_that_reads_is_fine(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    s.copy(c.din, c.hin)
    c.launch(s)
    c.din.close(stream=s)  # after the kernel in stream order
    assert c.din.closed


def test_stream_ordered_free_on_another_stream_needs_a_wait(dev, x):
    s1, s2 = dev.create_stream(), dev.create_stream()
    c = _pending_read_of_din(dev, x, s1)
    with hazard("launch double", "stream-ordered device buffer free", c.din.label):
        c.din.close(stream=s2)
    s2.wait(s1.record())
    c.din.close(stream=s2)


def test_closing_a_host_buffer_while_a_copy_is_pending(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    s.copy(c.din, c.hin)
    e = s.record()
    with hazard("copy h2d", "host buffer close", c.hin.label):
        c.hin.close()
    assert not c.hin.closed
    e.sync()
    c.hin.close()


def test_closing_a_d2h_destination_before_the_copy_lands(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    s.copy(c.hout, c.dout)
    with hazard("copy d2h", "host buffer close"):
        c.hout.close()


def test_a_released_pinned_buffer_is_poisoned(dev, x):
    h = dev.allocate_host(NB)
    h.view(np.float32, access="w")[:] = x
    raw = h._mem
    h.close()
    assert (raw == 0xEE).all()


# -- stream-ordered allocation ----------------------------------------------------------------------------------------
def test_stream_ordered_allocation_is_usable_on_its_stream(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    d = dev.allocate(NB, stream=s)
    s.copy(d, c.hin)
    s.sync()


def test_stream_ordered_allocation_used_on_another_stream_needs_a_wait(dev, x):
    c = Chain(dev, x)
    s1, s2 = dev.create_stream(), dev.create_stream()
    d = dev.allocate(NB, stream=s1)
    with hazard("stream-ordered allocate", "copy h2d"):
        s2.copy(d, c.hin)
    s2.wait(s1.record())
    s2.copy(d, c.hin)


# -- what orders the host ---------------------------------------------------------------------------------------------
def _pending_d2h(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    c.enqueue_pass(s)
    return c, s.record()


def test_is_done_true_orders_the_host_like_a_sync(x):
    dev = rf.device("sim")  # queries cost host time here, so polling progresses
    c, e = _pending_d2h(dev, x)
    while not e.is_done:
        pass
    assert np.array_equal(c.hout.view(np.float32, access="r"), x * 2)


def test_is_done_false_does_not_order_the_host(dev, x):
    c, e = _pending_d2h(dev, x)
    assert not e.is_done
    with hazard("copy d2h", "host view (r)"):
        c.hout.view(np.float32, access="r")


def test_a_thread_knows_only_what_it_saw_whatever_id_it_runs_on(dev, x):
    """The checker counts the orderings the library makes (syncs on a thread, publish and
    observe), not a thread's start or join. Python gives an ended thread's id to the next thread
    it starts, and that thread must not start out knowing what the ended one saw: each later
    thread's unsynced read of the d2h destination is flagged, on whichever id it runs."""
    c, e = _pending_d2h(dev, x)
    first = threading.Thread(target=e.sync)
    first.start()
    first.join()
    caught = []

    def read():
        try:
            c.hout.view(np.float32, access="r")
        except rf.HazardError as err:
            caught.append(err)

    for _ in range(3):
        t = threading.Thread(target=read)
        t.start()
        t.join()
    assert len(caught) == 3


def test_a_stream_sync_orders_the_host(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    c.enqueue_pass(s)
    s.sync()
    assert np.array_equal(c.hout.view(np.float32, access="r"), x * 2)


def test_wait_any_orders_the_host_after_what_it_returns(dev, x):
    c, e = _pending_d2h(dev, x)
    assert dev.wait_any([e]) == [e]
    assert np.array_equal(c.hout.view(np.float32, access="r"), x * 2)


def test_a_later_sync_orders_the_host_after_earlier_work_on_that_stream(dev, x):
    c, e = _pending_d2h(dev, x)
    s = dev.create_stream()
    s.wait(e)
    s.record().sync()  # transitively after e
    c.hout.view(np.float32, access="r")


def test_syncing_an_unrelated_stream_does_not_order_the_host(dev, x):
    c, e = _pending_d2h(dev, x)
    other = dev.create_stream()
    other.sync()
    with hazard("copy d2h", "host view (r)"):
        c.hout.view(np.float32, access="r")


def test_enqueue_orders_the_stream_after_the_hosts_earlier_writes(dev, x):
    # host write then enqueue of a copy reading it: program order, no event needed
    c = Chain(dev)
    s = dev.create_stream()
    c.hin.view(np.float32, access="w")[:] = x
    s.copy(c.din, c.hin)
    s.sync()


# -- launches --------------------------------------------------------------------------------------------------------
def test_undeclared_array_args_count_as_read_and_written(dev, x):
    c = Chain(dev, x)
    s1, s2 = dev.create_stream(), dev.create_stream()
    s1.launch(lambda a: None, c.din.array(np.float32, N))
    with hazard("launch <lambda>", "read of"):
        s2.launch(lambda a: None, c.din.array(np.float32, N), reads=[c.din])


def test_a_kernel_writing_an_array_declared_read_only_fails_loudly(dev):
    d, out = dev.allocate(NB), dev.allocate(NB)
    s = dev.create_stream()

    def sneaky(a, b):
        a[:] = 1  # declared in reads= only

    s.launch(sneaky, d.array(np.float32, N), out.array(np.float32, N), reads=[d], writes=[out])
    e = s.record()
    with pytest.raises(rf.LaunchError, match="read-only"):
        e.sync()


def test_a_launch_error_surfaces_at_the_next_event_on_that_stream(dev):
    s, other = dev.create_stream(), dev.create_stream()
    d = dev.allocate(8)

    def boom(a):
        raise ZeroDivisionError("kernel fault")

    s.launch(boom, d.array(np.uint8, 8))
    unrelated = other.record()
    e = s.record()
    assert e.error is None  # not done yet
    with pytest.raises(rf.LaunchError, match="kernel fault") as info:
        e.sync()
    err = info.value
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert e.error is err and not err.sticky
    assert "launch boom" in str(err) and "stream" in str(err)
    unrelated.sync()  # other streams are unaffected
    later = s.record()
    later.sync()  # reported once; the stream works again
    assert later.error is None


def test_stream_sync_raises_a_pending_launch_error(dev):
    s = dev.create_stream()
    d = dev.allocate(8)
    s.launch(lambda a: 1 / 0, d.array(np.uint8, 8))
    with pytest.raises(rf.LaunchError) as info:
        s.sync()
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_stream_sync_raises_a_launch_error_an_event_after_it_took_first(dev):
    # a timing event recorded after the failed launch reports the error; a later sync of the
    # stream must still raise it (once), as a synchronise on a real GPU after a fault would
    s = dev.create_stream()
    d = dev.allocate(8)
    s.launch(lambda a: 1 / 0, d.array(np.uint8, 8))
    mark = s.record(timing=True)
    with pytest.raises(rf.LaunchError, match="ZeroDivisionError.*reported first by an event"):
        s.sync()
    assert isinstance(mark.error.__cause__, ZeroDivisionError)
    s.sync()  # raised once by a sync: the stream works again
    s.launch(lambda a: 1 / 0, d.array(np.uint8, 8))
    with pytest.raises(rf.LaunchError):
        s.record().sync()
    with pytest.raises(rf.LaunchError):
        s.sync()  # raised by the event's sync, and by the stream's: both waited past it


# -- sticky errors -----------------------------------------------------------------------------------------------------
def test_a_sticky_error_breaks_every_later_call(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    s.copy(c.din, c.hin)
    e = s.record()
    dev.inject_sticky_error()
    calls = [
        lambda: e.sync(),
        lambda: e.is_done,
        lambda: s.copy(c.din, c.hin),
        lambda: s.record(),
        lambda: s.wait(e),
        lambda: c.launch(s),
        lambda: dev.allocate(8),
        lambda: dev.allocate_host(8),
        lambda: dev.create_stream(),
        lambda: dev.create_worker_pool(1),
        lambda: dev.wait_any([e]),
    ]
    for call in calls:
        with pytest.raises(rf.DeviceError, match="sticky") as info:
            call()
        assert info.value.sticky is True
        assert "restart the process" in str(info.value)
    # pinned memory stays host memory, as a GPU's pinned buffer is viewed without a CUDA call:
    # what the host wrote there before can still be read (to save it, say)
    assert c.hin.view(np.float32).shape == (c.hin.nbytes // 4,)


def test_a_sticky_error_while_blocked_in_sync(dev, x):
    c = Chain(dev, x)
    s = dev.create_stream()
    pool = dev.create_worker_pool(1)
    s.copy(c.din, c.hin)
    e = s.record()
    pool.submit(dev.inject_sticky_error, sim_seconds=0.0)  # the fault happens while the host waits
    with pytest.raises(rf.DeviceError) as info:
        e.sync()
    assert info.value.sticky


def test_cleanup_still_works_after_a_sticky_error(dev, x):
    c = Chain(dev, x)
    dev.inject_sticky_error()
    for b in (c.hin, c.hout, c.din, c.dout):
        b.close()
    assert dev.live().host_buffers == dev.live().device_buffers == 0


# -- leak accounting -----------------------------------------------------------------------------------------------------
def test_live_counts_track_everything_and_end_at_zero(dev, x):
    assert dev.live() == LiveCounts(0, 0, 0, 0)
    c = Chain(dev, x)
    s1, s2 = dev.create_stream(), dev.create_stream()
    s1.copy(c.din, c.hin)
    e1 = s1.record()
    s2.wait(e1)
    c.launch(s2)
    e2 = s2.record()
    e2.sync()
    live = dev.live()
    assert (live.host_buffers, live.device_buffers, live.streams, live.events) == (2, 2, 2, 2)
    assert live.total == 8
    for b in (c.hin, c.hout, c.din, c.dout):
        b.close()
    for s in (s1, s2):
        s.close()
    assert dev.live().events == 2  # events live until garbage-collected
    del e1, e2
    gc.collect()
    assert dev.live() == LiveCounts(0, 0, 0, 0)


@pytest.mark.parametrize("kind", ["device", "stream-ordered device", "pinned host", "registered host"])
def test_a_buffer_collected_unclosed_is_no_longer_live(dev, kind):
    """As on a GPU, where an allocation is freed with its last reference: the live counts fall
    with the memory in use, and a buffer closed before it is collected is taken off once."""
    s = dev.create_stream()
    before = dev.live()

    def make():
        if kind == "device":
            return dev.allocate(NB)
        if kind == "stream-ordered device":
            return dev.allocate(NB, stream=s)
        return dev.allocate_host(NB) if kind == "pinned host" else dev.register_host(np.zeros(N, np.float32))

    side = "device_buffers" if "device" in kind else "host_buffers"
    buf = make()
    assert dev.live().total == before.total + 1
    del buf
    gc.collect()
    assert dev.live() == before and dev.memory_in_use == 0
    assert dev.collected_unclosed()[side] == 1  # the collector released it, and the device says so
    closed = make()
    if kind == "stream-ordered device":
        closed.close(stream=s)
    else:
        closed.close()
    assert dev.live() == before
    del closed
    gc.collect()
    assert dev.live() == before  # not taken off a second time
    assert dev.collected_unclosed() == {"host_buffers": 0, "device_buffers": 0, "streams": 0, side: 1}
    s.close()
    assert dev.live().total == 0


def test_context_managers_close(dev):
    with dev.create_stream() as s, dev.allocate_host(64) as h, dev.allocate(64) as d:
        s.copy(d, h)
        s.sync()
    gc.collect()
    assert dev.live().total == 0


def test_a_context_manager_never_masks_the_users_exception(dev):
    s = dev.create_stream()
    with pytest.warns(RuntimeWarning, match="closing"), pytest.raises(KeyError):
        with dev.allocate_host(64) as h:
            d = dev.allocate(64)
            s.copy(d, h)  # pending when the block exits: close refuses, and only warns
            raise KeyError("the user's error")


def test_closing_twice_is_harmless(dev):
    s, h, d = dev.create_stream(), dev.allocate_host(8), dev.allocate(8)
    pool = dev.create_worker_pool(1)
    for obj in (s, h, d, pool, dev):
        obj.close()
        obj.close()
    assert dev.live().total == 0


# -- device memory in use ------------------------------------------------------------------------------------------------
MiB = 1 << 20


def test_allocations_add_up_to_the_device_memory():
    """Each allocation under the total used to succeed however many there were; a GPU refuses the
    one that would take the memory in use past its total, and stays usable after it."""
    dev = small_memory_device(MiB)
    a = dev.allocate(600_000)
    with pytest.raises(MemoryError, match=rf"allocate\(nbytes\) asks for 600000 bytes of device memory, but 600000 "
                                          rf"bytes of the device's total memory of {MiB} bytes are in use "
                                          rf"\({MiB - 600_000} free;.*close") as info:
        dev.allocate(600_000)
    err = info.value
    assert isinstance(err, rf.DeviceError) and not err.sticky  # an out-of-memory leaves the context usable
    assert dev.live().device_buffers == 1 and dev.memory_in_use == 600_000  # a refusal holds nothing
    b = dev.allocate(MiB - 600_000)  # exactly what is left fits
    with pytest.raises(MemoryError, match=f"asks for 1 bytes.*{MiB} bytes of the device's total memory"):
        dev.allocate(1)
    a.close()
    c = dev.allocate(600_000)  # the freed memory is there again
    assert dev.memory_in_use == MiB
    for buf in (b, c):
        buf.close()
    assert dev.memory_in_use == 0 and dev.live().total == 0


@pytest.mark.parametrize("how", ["close", "stream-ordered close", "with block", "collected unclosed",
                                 "close after a sticky error", "device close"])
def test_every_way_a_device_buffer_ends_gives_its_memory_back(how):
    dev = small_memory_device(MiB)
    s = dev.create_stream()
    kept = dev.allocate(1000)
    # a stream-ordered allocation counts from the call, as if its stream had reached it
    buf = dev.allocate(600_000, stream=s if how == "stream-ordered close" else None)
    assert dev.memory_in_use == 601_000
    if how == "close":
        buf.close()
    elif how == "stream-ordered close":
        buf.close(stream=s)
    elif how == "with block":
        with buf:
            pass
    elif how == "collected unclosed":
        del buf
        gc.collect()
    elif how == "close after a sticky error":
        dev.inject_sticky_error()
        buf.close()
    else:
        dev.close()  # the context, and all its memory, is gone
        assert dev.memory_in_use == 0
        return
    assert dev.memory_in_use == 1000
    if how != "close after a sticky error":
        dev.allocate(MiB - 1000).close()  # all of it is there for the next allocation
    kept.close()
    assert dev.memory_in_use == 0


def test_a_refused_free_keeps_its_memory_in_use(x):
    dev = small_memory_device(MiB)
    c = Chain(dev, x)
    s = dev.create_stream()
    s.copy(c.din, c.hin)
    e = s.record()
    with hazard("copy h2d", "device buffer free"):
        c.din.close()
    assert dev.memory_in_use == 2 * NB  # not freed, so still counted
    e.sync()
    c.din.close()
    assert dev.memory_in_use == NB


def test_memory_in_use_adds_up_across_threads():
    """Threads allocating and freeing at once never take the memory in use past the total, and
    every byte comes back."""
    nbytes, room = 20_000, 3
    dev = small_memory_device(room * nbytes)
    peak = []

    def churn():
        refused = 0
        for _ in range(100):
            try:
                buf = dev.allocate(nbytes)
            except MemoryError:
                refused += 1
                continue
            peak.append(dev.memory_in_use)
            buf.close()
        return refused

    refused = run_all([churn] * 6)
    assert max(peak) <= room * nbytes
    assert sum(refused) + len(peak) == 600
    assert dev.memory_in_use == 0 and dev.live().device_buffers == 0


# -- host worker pools ---------------------------------------------------------------------------------------------------
def _a_task_filling_the_input(dev, x, workers: int) -> tuple:
    """A :class:`Chain` on ``dev``, a stream, and a task on a new pool of ``workers`` that writes
    ``x`` into the chain's pinned input (one virtual millisecond): ``(chain, stream, task)``."""
    c = Chain(dev)
    s = dev.create_stream()
    pool = dev.create_worker_pool(workers)

    def prepare():
        c.hin.view(np.float32, access="w")[:] = x

    return c, s, pool.submit(prepare, sim_seconds=1e-3)


def test_a_tasks_host_views_are_that_lanes_accesses(x):
    dev = rf.device("sim")  # the copy's enqueue overhead lets the task start first
    c, s, t = _a_task_filling_the_input(dev, x, workers=2)
    with hazard("host view (w)", "host worker 0 of pool", "copy h2d", "write of", "read of"):
        s.copy(c.din, c.hin)  # the host has not seen the task finish
    t.sync()
    c.enqueue_pass(s)
    s.sync()
    assert np.array_equal(c.hout.view(np.float32, access="r"), x * 2)


def test_a_hazard_found_inside_a_task_is_its_result(dev, x):
    # on the unit profile the task starts only when the host blocks, after the copy was enqueued:
    # the conflict is then found by the task's own access and delivered by result()
    c, s, t = _a_task_filling_the_input(dev, x, workers=1)
    s.copy(c.din, c.hin)
    t.sync()
    with hazard("copy h2d", "host view (w)", "host worker 0 of pool"):
        t.result()


@pytest.mark.parametrize("how", ["sync", "is_done", "wait_any"])
def test_observing_a_task_done_orders_the_host_after_it(how):
    dev = rf.device("sim")
    h = dev.allocate_host(64)
    pool = dev.create_worker_pool(1)
    t = pool.submit(lambda: h.view(np.uint8, access="w").fill(9), sim_seconds=1e-4)
    if how == "sync":
        t.sync()
    elif how == "is_done":
        while not t.is_done:
            pass
    else:
        assert dev.wait_any([t]) == [t]
    assert (h.view(np.uint8, access="r") == 9).all()


def test_a_task_is_ordered_after_what_the_host_did_before_submitting(dev, x):
    c, e = _pending_d2h(dev, x)
    e.sync()
    pool = dev.create_worker_pool(1)
    t = pool.submit(lambda: c.hout.view(np.float32, access="r").copy(), sim_seconds=1e-4)
    t.sync()
    assert np.array_equal(t.result(), x * 2)


def test_a_task_that_reads_unsynced_d2h_output_is_caught(dev, x):
    c, e = _pending_d2h(dev, x)
    pool = dev.create_worker_pool(1)
    t = pool.submit(lambda: c.hout.view(np.float32, access="r").copy(), sim_seconds=1e-4)
    t.sync()
    with pytest.raises(rf.HazardError, match="host worker"):
        t.result()


def test_a_task_may_not_block(dev, x):
    c, e = _pending_d2h(dev, x)
    pool = dev.create_worker_pool(1)
    t = pool.submit(e.sync)
    t.sync()
    with pytest.raises(RuntimeError, match="must not block"):
        t.result()


def test_task_result_before_done_says_to_wait(dev):
    pool = dev.create_worker_pool(1)
    t = pool.submit(lambda: 1, sim_seconds=1.0)
    with pytest.raises(RuntimeError, match="wait for it"):
        t.result()


def test_a_task_exception_is_delivered_by_result(dev):
    pool = dev.create_worker_pool(1)
    t = pool.submit(lambda: {}["missing"], sim_seconds=1e-3)
    t.sync()  # sync does not raise it
    with pytest.raises(KeyError):
        t.result()


def test_two_unordered_tasks_writing_the_same_bytes_race_even_on_one_lane():
    """b runs on a's worker thread after a, but nothing orders them (a real pool could run them
    at once): the checker must not take the thread's history for an order. (A lane's clock once
    accumulated across its tasks, and this passed unseen.)"""
    dev = unit_device()
    h = dev.allocate_host(64)
    pool = dev.create_worker_pool(2)

    def write():
        h.view(np.uint8, access="w")[:] = 1

    long = pool.submit(lambda: None, sim_seconds=10e-3)  # holds one lane
    a = pool.submit(write, sim_seconds=1e-3)
    b = pool.submit(write, sim_seconds=1e-3)  # runs on a's lane after it
    for t in (long, a, b):
        t.sync()
    with pytest.raises(rf.HazardError):
        b.result()


def test_tasks_ordered_through_the_host_share_one_checker_actor():
    """A task whose submitter saw the previous task finish continues that task's actor (the two
    really are ordered), so a long run of observed tasks keeps the vector clocks small."""
    dev = unit_device()
    h = dev.allocate_host(64)
    pool = dev.create_worker_pool(2)
    for i in range(200):
        t = pool.submit(lambda i=i: h.view(np.uint8, access="w").fill(i % 251), sim_seconds=1e-4)
        t.sync()
        t.result()
    assert len(pool._actors) == 1
    assert (h.view(np.uint8, access="r") == 199 % 251).all()


def test_unobserved_tasks_get_actors_of_their_own_until_observed():
    dev = unit_device()
    pool = dev.create_worker_pool(2)
    tasks = [pool.submit(lambda: None, sim_seconds=1e-4) for _ in range(5)]
    for t in tasks:
        t.sync()
    assert len(pool._actors) == 5  # none had seen another finish when it was submitted
    more = [pool.submit(lambda: None, sim_seconds=1e-4) for _ in range(5)]
    for t in more:
        t.sync()
    assert len(pool._actors) == 5  # all five were seen finished before these were submitted


def test_a_task_ordered_after_another_by_the_host_may_overwrite_its_bytes():
    dev = unit_device()
    h = dev.allocate_host(64)
    pool = dev.create_worker_pool(2)
    long = pool.submit(lambda: None, sim_seconds=10e-3)
    a = pool.submit(lambda: h.view(np.uint8, access="w").fill(1), sim_seconds=1e-3)
    a.sync()  # the host sees a finish before submitting b
    b = pool.submit(lambda: h.view(np.uint8, access="w").fill(2), sim_seconds=1e-3)
    for t in (long, b):
        t.sync()
    b.result()
    assert (h.view(np.uint8, access="r") == 2).all()


# -- the rest of the protocol -------------------------------------------------------------------------------------------
def test_capabilities_come_from_the_profile():
    caps = rf.device("sim").capabilities
    assert isinstance(caps, Capabilities)
    assert caps.backend == "sim" and caps.sm_count == 132 and caps.async_engine_count == 3
    assert caps.compute_capability == (9, 0) and caps.memory_pools and caps.host_register
    assert caps.stream_priorities == (0, -5)
    assert caps.as_dict()["name"] == "simulated h200-pcie5"


def test_auto_without_a_gpu_is_the_sim():
    ok, _ = rf.cuda_available()
    if ok:
        pytest.skip("a GPU is usable here; 'auto' picks it")
    assert rf.device("auto").backend == "sim"


def test_registered_host_memory_is_the_users_array(dev, x):
    arr = x.copy()
    out = np.zeros(N, np.float32)
    s = dev.create_stream()
    hin, hout = dev.register_host(arr), dev.register_host(out)
    assert hin.registered and hin.nbytes == NB
    d, dout = dev.allocate(NB), dev.allocate(NB)
    s.copy(d, hin)
    s.launch(double, d.array(np.float32, N), dout.array(np.float32, N), reads=[d], writes=[dout])
    s.copy(hout, dout)
    with hazard("copy d2h", "host view (r)"):
        hout.view(np.float32, access="r")
    s.sync()
    assert np.array_equal(out, x * 2)  # landed in the user's own array
    hin.close()
    hout.close()
    assert np.array_equal(arr, x)  # a registered array is not poisoned on close


def test_slices_copy_part_of_a_buffer(dev):
    h = dev.allocate_host(16)
    h.view(np.uint8, access="w")[:] = np.arange(16, dtype=np.uint8)
    d, back = dev.allocate(16), dev.allocate_host(16)
    s = dev.create_stream()
    s.fill(d, 0)
    s.copy(d.slice(4, 8), h.slice(8, 8))
    s.copy(back, d)
    s.sync()
    assert list(back.view(np.uint8, access="r")) == [0] * 4 + list(range(8, 16)) + [0] * 4


def test_view_offset_and_count(dev):
    h = dev.allocate_host(32)
    h.view(np.uint8, access="w")[:] = np.arange(32, dtype=np.uint8)
    v = h.view(np.uint32, offset=8, count=2, access="r")
    assert v.shape == (2,) and not v.flags.writeable
    assert v.tobytes() == bytes(range(8, 16))


def test_fresh_device_memory_is_poisoned_when_checked(dev):
    d, h = dev.allocate(16), dev.allocate_host(16)
    s = dev.create_stream()
    s.copy(h, d)
    s.sync()
    assert (h.view(np.uint8, access="r") == 0xCD).all()


def test_after_a_sticky_error_buffers_close_without_hazards():
    import warnings

    dev = rf.device("sim")
    s = dev.create_stream()
    h, d = dev.allocate_host(1024), dev.allocate(1024)
    s.copy(d, h)  # pending when the context dies: nothing can ever order it now
    dev.inject_sticky_error()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.close()
        d.close()
    assert dev.live().host_buffers == 0 and dev.live().device_buffers == 0
    with pytest.raises(rf.DeviceError, match="sticky"):
        s.record()


def test_after_another_thread_closed_the_device_buffers_close_without_hazards():
    """A device closed by another thread while this one's copies were in flight: the close ran
    them all to completion and nothing runs after it, so freeing (and unregistering) here cannot
    race with any of them, though this thread never saw them complete (it cannot sync a closed
    device). As after a sticky error, the release is not checked; it used to be a HazardError
    in the clean-up of every call whose device was closed under it."""
    import warnings

    dev = rf.device("sim", checked=True)
    s = dev.create_stream()
    arr = np.ones(256, np.float32)
    h, reg, d = dev.allocate_host(1024), dev.register_host(arr), dev.allocate(1024)
    s.copy(d, reg)
    s.copy(h, d)
    bounded(dev.close)
    with pytest.raises(RuntimeError, match="closed"):
        s.sync()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d.close(stream=None)
        h.close()
        reg.close()
    assert d.closed and h.closed and reg.closed
    assert dev.live().host_buffers == 0 and dev.live().device_buffers == 0


def test_each_call_on_a_dead_context_raises_its_own_sticky_error():
    """Like each failing CUDA call: a new DeviceError per call, caused by the first, so each
    traceback shows where that call was made."""
    from ringflow._errors import DeviceError

    dev = rf.device("sim")
    dev.inject_sticky_error()
    errors = []
    for _ in range(2):
        with pytest.raises(DeviceError) as info:
            dev.create_stream()
        errors.append(info.value)
    a, b = errors
    assert a is not b and a.sticky and b.sticky
    assert a.__cause__ is b.__cause__ is dev._sticky
    assert str(a) == str(dev._sticky)


def test_a_fault_of_the_sim_while_starting_a_task_fails_the_task_not_the_wait(monkeypatch):
    """An error raised while the sim starts a task (not by the task's callable) is the task's
    result; the task still completes, so a pipeline reports it instead of hanging in close."""
    from ringflow._device.sim import pool as sim_pool

    original = sim_pool.SimWorkerPool._take_actor
    calls = []

    def fails_fifth(self, clock):
        calls.append(1)
        if len(calls) == 5:
            raise AttributeError("a fault inside the simulator")
        return original(self, clock)

    monkeypatch.setattr(sim_pool.SimWorkerPool, "_take_actor", fails_fifth)
    dev = rf.device("sim")
    x = np.random.default_rng(0).random(1 << 14).astype(np.float32)

    def f(a, b):
        b[...] = a

    with pytest.raises(rf.StageError) as info:
        rf.stream_map(f, x, device=dev, chunk_bytes=1 << 10, host="stage")
    assert isinstance(info.value.__cause__, AttributeError)
    del info  # its traceback holds the failed chunks' events
    gc.collect()
    rf.drop_warm_pipelines(dev)
    assert dev.live().total == 0


def test_fold_tokens_keeps_exactly_what_orders_a_thread():
    """A later token of one thread covers its earlier ones; tokens of threads that never met are
    both kept; observing the folded list orders as observing all of them does."""
    dev = rf.device("sim", seed=1)
    first = dev.publish()
    buf = dev.allocate_host(64)
    buf.view(np.uint8, access="w")[:] = 1
    later = dev.publish()
    own = dev.allocate_host(64)

    def elsewhere():  # a thread that did something and saw nothing of this one
        own.view(np.uint8, access="w")[:] = 3
        return dev.publish()

    other = bounded(elsewhere)
    assert dev.fold_tokens([first, later]) == [later]
    assert dev.fold_tokens([later, first]) == [later]
    assert dev.fold_tokens([first, other, later, None]) == [other, later]

    def write_after(tokens):
        for t in tokens:
            dev.observe(t)
        buf.view(np.uint8, access="w")[:] = 2
        return dev.publish()

    done = bounded(lambda: write_after(dev.fold_tokens([first, later])))  # ordered: no HazardError
    with pytest.raises(rf.HazardError):
        bounded(lambda: write_after(dev.fold_tokens([first])))  # the write above is not covered
    for t in (done, other):
        dev.observe(t)
    buf.close()
    own.close()


_FORK_CHILD = textwrap.dedent("""
    import os, signal, sys, threading
    import numpy as np
    import ringflow as rf
    from tests.helpers.forks import leave_child

    d = rf.device("sim")
    named = rf.device("sim:3")
    named.allocate(8).close()
    held, go = threading.Event(), threading.Event()

    def hold():  # a thread inside a device call at the moment of fork()
        with d._lock:
            held.set()
            go.wait(30)

    threading.Thread(target=hold, daemon=True).start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang in the child ends it, and the parent sees the signal
        lines = []
        for name, call in (("allocate", lambda: d.allocate(8)), ("stream", d.create_stream),
                           ("named", lambda: named.allocate(8))):
            try:
                call()
                lines.append(f"{name}: worked")
            except RuntimeError as exc:
                lines.append(f"{name}: {exc}")
        fresh = rf.device("sim:3")  # a named device of the child's own
        fresh.allocate(8).close()
        lines.append(f"named again: {'new' if fresh is not named else 'the parent'}")
        leave_child(lines)
    _, status = os.waitpid(pid, 0)
    go.set()
    d.allocate(8).close()
    print("child status", status)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_device_made_before_fork_refuses_the_child_and_never_hangs_it():
    """A thread of the parent held the device's lock at fork(): the child's first call waited for
    it for ever. The child now gets a RuntimeError naming fork, and makes devices of its own."""
    run = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    out = run.stdout
    assert run.returncode == 0, run.stderr[-2000:]
    assert "child status 0" in out, out + run.stderr[-2000:]
    for name in ("allocate", "stream", "named"):
        assert f"{name}: this simulated GPU was made in a parent process before fork()" in out, out
    assert "named again: new" in out, out


def test_a_worker_pool_closes_quietly_after_its_device(dev):
    """The device's close completed every task: a pool closed after it has nothing to wait for,
    and raised that the device is closed (a clean-up in a finally block then masked the error
    being handled)."""
    pool = dev.create_worker_pool(2)
    done = []
    pool.submit(lambda: done.append(1))
    dev.close()
    pool.close()
    pool.close()  # twice: harmless
    assert done == [1]


def test_a_stream_collected_unclosed_is_no_longer_live(dev):
    """As on a GPU, where a stream is destroyed with its last reference: the live count falls and
    the simulated engine stops visiting its queue; one closed before it is collected is taken off
    once. (Its ids are counted apart from the buffers': a stream and a buffer of one id are two.)"""
    queues = len(dev._engine._queues)
    buf = dev.allocate(NB)
    s = dev.create_stream()
    assert dev.live().streams == 1 and len(dev._engine._queues) == queues + 1
    del s
    gc.collect()
    assert dev.live().streams == 0 and len(dev._engine._queues) == queues
    assert dev.live().device_buffers == 1  # the buffer is still there
    assert dev.collected_unclosed()["streams"] == 1
    closed = dev.create_stream()
    closed.close()
    del closed
    gc.collect()
    assert dev.live().streams == 0 and dev.live().device_buffers == 1
    assert dev.collected_unclosed() == {"host_buffers": 0, "device_buffers": 0, "streams": 1}
    buf.close()
    assert dev.live().total == 0


def test_the_checkers_clocks_stay_bounded_over_many_pipelines():
    # a notebook on one simulated GPU: every call a new compute (a lambda made there), so a new
    # engine each time, with streams, a worker pool and threads of its own; the checker's clocks
    # must keep only what is alive, or each call costs more memory and time than the last
    dev = unit_device()
    x = np.arange(256, dtype=np.float32)
    for _ in range(80):
        rf.stream_map(lambda a, b: b.__setitem__(..., a), x, device=dev, chunk_bytes=256)
    actors, entries = dev._checker.size()
    rf.drop_warm_pipelines(dev)
    assert actors < 200 and entries < 200 * 40, (actors, entries)


def test_the_checkers_clocks_forget_ended_host_threads():
    # each host thread that touches the device is an actor of the checker: one that has ended
    # makes no more accesses, so its clock goes
    dev = unit_device()
    s = dev.create_stream()

    def sync_on_a_thread():
        s.record().sync()

    for _ in range(300):
        t = threading.Thread(target=sync_on_a_thread)
        t.start()
        t.join()
    actors, entries = dev._checker.size()
    s.close()
    assert actors < 150 and entries < 150 * 150, (actors, entries)


def test_a_closed_worker_pool_leaves_nothing_in_the_engine():
    # every engine a device builds has a worker pool of its own, and a long-lived device builds
    # thousands: a closed pool's lanes and count of busy ones must go with it
    dev = unit_device()
    before = (dict(dev._engine._capacity), dict(dev._engine._busy), len(dev._engine._queues))
    for _ in range(50):
        pool = dev.create_worker_pool(2)
        pool.submit(lambda: None).sync()
        pool.close()
    after = (dict(dev._engine._capacity), dict(dev._engine._busy), len(dev._engine._queues))
    assert after == before
