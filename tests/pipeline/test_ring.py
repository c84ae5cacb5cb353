"""Rings: slot hand-out order, ownership bookkeeping, the transition check and the hook."""

import pytest

import ringflow as rf
from ringflow._pipeline.ring import Ring, allocate_ring
from ringflow._pipeline.states import IllegalTransition, RingKind, SlotState

S = SlotState


@pytest.fixture
def dev():
    d = rf.device("sim")
    yield d
    d.close()


def make_ring(dev, kind=RingKind.HOST_IN, count=3, chunk_bytes=64, hook=None):
    buf = dev.allocate_host(count * chunk_bytes) if kind in (RingKind.HOST_IN, RingKind.HOST_OUT) \
        else dev.allocate(count * chunk_bytes)
    return Ring(kind, buf, count, chunk_bytes, hook)


def test_slots_tile_the_buffer(dev):
    ring = make_ring(dev, count=4, chunk_bytes=32)
    assert len(ring) == 4 and ring.free_count == 4 and ring.busy_count == 0
    assert [s.where.range for s in ring.slots] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert all(s.where.buffer is ring.buffer for s in ring.slots)
    ring.close()
    assert ring.buffer.closed


def test_a_stride_spaces_the_slots_of_a_ring_and_its_allocation(dev):
    """Slots of 1001 bytes one every 1024: each starts where a GPU can read any dtype from."""
    buf = allocate_ring(dev.allocate, RingKind.DEVICE_IN, 1001, 3, 1024)
    assert buf.nbytes == 2 * 1024 + 1001
    ring = Ring(RingKind.DEVICE_IN, buf, 3, 1001, stride=1024)
    assert [s.where.range for s in ring.slots] == [(0, 1001), (1024, 2025), (2048, 3049)]
    ring.close()
    with pytest.raises(ValueError, match="stride"):
        Ring(RingKind.DEVICE_IN, dev.allocate(64), 1, 64, stride=32)


def test_acquire_until_full_then_none(dev):
    ring = make_ring(dev, count=2)
    a = ring.acquire(0, S.FILLING)
    b = ring.acquire(1, S.FILLING)
    assert (a.owner, b.owner) == (0, 1) and a is not b
    assert a.state is S.FILLING and ring.busy_count == 2
    assert ring.acquire(2, S.FILLING) is None
    ring.close()


def test_oldest_freed_first_rotation(dev):
    ring = make_ring(dev, kind=RingKind.DEVICE_IN, count=3)
    order = []
    for owner in range(7):
        slot = ring.acquire(owner, S.COPYING_IN)
        order.append(slot.index)
        ring.move(slot, S.COMPUTING)
        ring.release(slot)
    assert order == [0, 1, 2, 0, 1, 2, 0]  # reuse rotates through the whole ring
    ring.close()


def test_release_clears_owner_and_fence(dev):
    ring = make_ring(dev, kind=RingKind.HOST_OUT, count=1)
    slot = ring.acquire(5, S.COPYING_OUT)
    slot.fence = object()
    ring.move(slot, S.CONSUMING)
    ring.release(slot)
    assert slot.state is S.FREE and slot.owner is None and slot.fence is None
    assert ring.free_count == 1
    ring.close()


@pytest.mark.parametrize("kind,first,bad", [
    (RingKind.HOST_IN, S.FILLING, S.COPYING_IN),  # skipping FILLED
    (RingKind.DEVICE_IN, S.COPYING_IN, S.COPYING_OUT),  # device-in never copies out
    (RingKind.DEVICE_OUT, S.COMPUTING, S.FREE),  # freed before its D2H
    (RingKind.HOST_OUT, S.COPYING_OUT, S.FREE),  # freed before the consumer ran
    (RingKind.DEVICE_INPLACE, S.COPYING_IN, S.COPYING_OUT),  # skipped compute
])
def test_illegal_move_raises_at_once_and_leaves_state(dev, kind, first, bad):
    ring = make_ring(dev, kind=kind, count=1)
    slot = ring.acquire(3, first)
    with pytest.raises(IllegalTransition, match=rf"chunk 3\): illegal transition {first.name} -> {bad.name}"):
        ring.move(slot, bad)
    assert slot.state is first
    ring.close()


def test_acquire_into_illegal_state_raises(dev):
    ring = make_ring(dev, kind=RingKind.HOST_IN, count=1)
    with pytest.raises(IllegalTransition):
        ring.acquire(0, S.COMPUTING)
    ring.close()


def test_draining_path(dev):
    ring = make_ring(dev, kind=RingKind.DEVICE_OUT, count=1)
    slot = ring.acquire(0, S.COMPUTING)
    ring.move(slot, S.DRAINING)
    with pytest.raises(IllegalTransition):
        ring.move(slot, S.COPYING_OUT)  # a draining slot only goes FREE
    ring.release(slot)
    assert slot.state is S.FREE
    with pytest.raises(IllegalTransition):
        ring.move(slot, S.DRAINING)  # a free slot has nothing to drain
    ring.close()


def test_hook_sees_every_transition(dev):
    seen = []
    ring = make_ring(dev, kind=RingKind.HOST_IN, count=1, hook=lambda k, s, o, n: seen.append((k, s.owner, o, n)))
    slot = ring.acquire(9, S.FILLING)
    ring.move(slot, S.FILLED)
    ring.move(slot, S.COPYING_IN)
    ring.release(slot)
    assert seen == [(RingKind.HOST_IN, 9, S.FREE, S.FILLING), (RingKind.HOST_IN, 9, S.FILLING, S.FILLED),
                    (RingKind.HOST_IN, 9, S.FILLED, S.COPYING_IN), (RingKind.HOST_IN, 9, S.COPYING_IN, S.FREE)]
    ring.close()


def test_zero_slots_refused(dev):
    buf = dev.allocate_host(64)
    with pytest.raises(ValueError, match="at least 1 slot"):
        Ring(RingKind.HOST_IN, buf, 0, 64)
    buf.close()


def test_slot_counts_validation():
    with pytest.raises(ValueError, match="host_in"):
        rf.SlotCounts(0, 1, 1, 1)
    with pytest.raises(ValueError, match="host_out"):
        rf.SlotCounts(1, 1, 1, 0)
    with pytest.raises(ValueError, match="device_out"):
        rf.SlotCounts(1, 1, -1, 1)
    c = rf.SlotCounts(2, 3, 4, 5)
    assert c.pinned_slots == 7 and c.minus("device_in") == rf.SlotCounts(2, 2, 4, 5)


def test_external_ring_slots_cover_the_callers_buffer_when_taken(dev):
    """One slot per chunk of the caller's buffer, the last one short; ranges are made when a
    slot is taken, and rebinding to another buffer hands slots out in index order again."""
    buf = dev.allocate_host(100)
    ring = Ring(RingKind.HOST_IN, buf, 4, 32, external=True)
    assert all(s.where is None for s in ring.slots)
    got = [ring.acquire(i, S.FILLING) for i in range(4)]
    assert [s.where.range for s in got] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert all(s.where.buffer is buf for s in got)
    with pytest.raises(RuntimeError, match="idle"):
        ring.rebind(None)
    for s in reversed(got):
        ring.move(s, S.DRAINING)
        ring.release(s)
    other = dev.allocate_host(97)
    ring.rebind(other)
    again = [ring.acquire(i, S.FILLING) for i in range(4)]
    assert [s.index for s in again] == [0, 1, 2, 3]
    assert [s.where.range for s in again] == [(0, 32), (32, 64), (64, 96), (96, 97)]
    assert all(s.where.buffer is other for s in again)
    for s in again:
        ring.move(s, S.DRAINING)
        ring.release(s)
    with pytest.raises(ValueError, match="slots"):
        ring.rebind(dev.allocate_host(200))
    ring.close()
    assert not buf.closed  # the caller's memory is never closed by the ring
    buf.close()
    other.close()


def refuse_more_than(dev, monkeypatch, method, most):
    """Make ``dev.<method>`` fail as numpy does for a request over ``most`` bytes (a test cannot
    ask for hundreds of GiB: where the system overcommits, numpy would get them)."""
    real = getattr(dev, method)

    def allocate(nbytes, *a, **k):
        if nbytes > most:
            raise MemoryError(f"Unable to allocate {nbytes} bytes")
        return real(nbytes, *a, **k)

    monkeypatch.setattr(dev, method, allocate)


@pytest.mark.parametrize("method", ["allocate_host", "allocate"])
def test_a_ring_too_large_to_allocate_names_chunk_bytes_and_the_slots(dev, monkeypatch, method):
    """It was numpy's bare "Unable to allocate 600. GiB", naming neither, and what was made
    before it is freed."""
    refuse_more_than(dev, monkeypatch, method, 1 << 20)
    chunk = 1 << 20
    with pytest.raises(MemoryError, match=rf"3 slots of chunk_bytes={chunk} bytes, {3 * chunk} bytes.*smaller "
                                          r"chunk_bytes or fewer slots") as info:
        rf.Pipeline(lambda x, y: None, device=dev, chunk_bytes=chunk, slots=3)
    assert "Unable to allocate" not in str(info.value)
    # the public out-of-memory error, whichever allocation refused (numpy's MemoryError here)
    assert isinstance(info.value, rf.OutOfMemoryError) and not info.value.sticky
    assert dev.live().total == 0


def test_a_ring_larger_than_the_device_memory_names_chunk_bytes_and_the_slots(dev):
    """The simulated GPU refuses more than its total memory; the ring says which options asked."""
    from ringflow._pipeline.ring import allocate_ring

    chunk, count = 1 << 30, 1 + dev.capabilities.total_memory // (1 << 30)
    with pytest.raises(MemoryError, match=rf"device-in ring: {count} slots of chunk_bytes={chunk} bytes.*smaller "
                                          r"chunk_bytes or fewer slots"):
        allocate_ring(dev.allocate, RingKind.DEVICE_IN, chunk, count)
    assert dev.live().total == 0


def test_a_direct_engine_ring_too_large_to_allocate_names_chunk_bytes_and_the_slots(dev, monkeypatch):
    import numpy as np

    refuse_more_than(dev, monkeypatch, "allocate", 4096)
    x = np.ones(1 << 12, np.float32)
    with pytest.raises(MemoryError, match=r"device-in ring: \d+ slots of chunk_bytes=4096 bytes.*smaller chunk_bytes"):
        rf.stream_map(lambda x, y: None, x, device=dev, chunk_bytes=4096, engine="direct", host="register")
    rf.drop_warm_pipelines(dev)
    assert dev.live().total == 0


def _twice(x, y):
    y[:] = x * 2


def test_a_second_pipeline_whose_rings_do_not_fit_beside_the_first_names_chunk_bytes():
    """Each pipeline's rings fit the device alone and not both together: the simulated GPU used to
    start both, where a real GPU refuses the second. The refusal names chunk_bytes, leaves nothing
    of the second behind, and the first runs on."""
    import numpy as np

    from tests.helpers import small_memory_device

    chunk = 128 << 10
    dev = small_memory_device(1 << 20)
    first = rf.Pipeline(_twice, device=dev, chunk_bytes=chunk, slots=3)
    live = dev.live()
    with pytest.raises(MemoryError, match=rf"device-\w+ ring: \d+ slots of chunk_bytes={chunk} bytes.*more than there "
                                          r"is free; give a smaller chunk_bytes or fewer slots") as info:
        rf.Pipeline(_twice, device=dev, chunk_bytes=chunk, slots=3)
    # the device's own account stays attached: how much was in use
    assert isinstance(info.value.__cause__, rf.DeviceError) and "in use" in str(info.value.__cause__)
    assert isinstance(info.value, rf.OutOfMemoryError)  # caught as such, as the device's own refusal is
    del info
    assert dev.live() == live  # the second's streams and rings are gone
    items = [np.full(1000, k, np.float32) for k in range(5)]
    assert all((got == 2 * item).all() for got, item in zip(first.map(items), items, strict=True))
    first.close()
    assert dev.live().total == 0
    with rf.Pipeline(_twice, device=dev, chunk_bytes=chunk, slots=3) as again:  # alone it fits
        assert (again.submit(items[1]).result() == 2).all()
    assert dev.live().total == 0


@pytest.mark.parametrize("ring", ["device-in", "device-out", "host-in", "host-out"])
def test_a_pipeline_whose_ring_cannot_be_allocated_leaves_nothing_and_pins_nothing_first(monkeypatch, ring):
    """The device rings are allocated before the host rings: one the GPU has no room for fails
    before any host memory is pinned. Whichever ring fails, what was made before it is freed:
    the live counts and the device memory in use are back where they were."""
    from ringflow._errors import OutOfMemoryError
    from tests.helpers import small_memory_device

    chunk = 64 << 10
    slots = rf.SlotCounts(host_in=2, device_in=2, device_out=2, host_out=2)
    # room for the device-in ring alone, for both device rings, or for more
    dev = small_memory_device({"device-in": chunk, "device-out": 3 * chunk}.get(ring, 8 * chunk))
    pinned = []
    real = dev.allocate_host
    refuse_from = {"host-in": 1, "host-out": 2}.get(ring)

    def allocate_host(nbytes):
        pinned.append(nbytes)
        if refuse_from is not None and len(pinned) >= refuse_from:
            raise OutOfMemoryError(f"no pinned memory for {nbytes} bytes")
        return real(nbytes)

    monkeypatch.setattr(dev, "allocate_host", allocate_host)
    other = dev.allocate(chunk // 2)  # what the device holds already
    before, in_use = dev.live(), dev.memory_in_use
    with pytest.raises(MemoryError, match=rf"{ring} ring: 2 slots of chunk_bytes={chunk} bytes.*smaller chunk_bytes"):
        rf.Pipeline(_twice, device=dev, chunk_bytes=chunk, slots=slots)
    if ring.startswith("device"):
        assert pinned == []  # no host memory was pinned for a pipeline that could not run
    assert dev.live() == before and dev.memory_in_use == in_use
    other.close()
    assert dev.live().total == 0


@pytest.mark.parametrize("engine, host", [("direct", "register"), ("pipeline", "stage")])
def test_a_job_whose_rings_exceed_the_device_memory_left_names_chunk_bytes(engine, host):
    import numpy as np

    from tests.helpers import small_memory_device

    dev = small_memory_device(1 << 20)
    other = dev.allocate((1 << 20) - (100 << 10))  # memory another user of the device holds
    x = np.ones(1 << 16, np.float32)  # 256 KiB: 4 chunks of 64 KiB
    with pytest.raises(MemoryError, match=r"device-\w+ ring: \d+ slots of chunk_bytes=65536 bytes.*smaller "
                                          r"chunk_bytes or fewer slots"):
        rf.MapJob(_twice, x, device=dev, chunk_bytes=64 << 10, engine=engine, host=host)
    assert dev.live().total == dev.live().device_buffers == 1  # only the other user's buffer
    other.close()
    with rf.MapJob(_twice, x, device=dev, chunk_bytes=64 << 10, engine=engine, host=host) as job:
        assert (job() == 2).all()
    assert dev.live().total == 0
