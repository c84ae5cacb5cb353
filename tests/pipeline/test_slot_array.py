"""``ringflow.host.empty_slot``: a prepare that builds its array in the pinned slot its item
goes to; the stage then copies nothing."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from ringflow._pipeline import api
from tests.helpers import process_prepare as pp
from tests.helpers.pipeline_checks import check_kept_slot_items


def double_plus_one(x, y):
    y[:] = x * 2 + 1


def in_slot(i):
    out = rf.host.empty_slot((i % 13 + 1, 3), np.float32)
    out[:] = i
    return out


def fresh(i):
    return np.full((i % 13 + 1, 3), i, np.float32)


@pytest.fixture
def copies(monkeypatch):
    made = []
    real = api._copy_array_in

    def counting(arr, raw, chunk_bytes):
        made.append(arr.nbytes)
        return real(arr, raw, chunk_bytes)

    monkeypatch.setattr(api, "_copy_array_in", counting)
    return made


@pytest.mark.parametrize("seed", range(4))
def test_an_array_made_in_the_slot_moves_with_no_copy_and_comes_back_exact(copies, seed):
    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    with rf.Pipeline(double_plus_one, device=dev, chunk_bytes=1024, prepare=in_slot, workers=3,
                     checked=True) as pipe:
        out = list(pipe.map(range(40)))
    for i, r in enumerate(out):
        np.testing.assert_array_equal(r, np.full((i % 13 + 1, 3), 2 * i + 1, np.float32))
    assert copies == []
    with rf.Pipeline(double_plus_one, device=dev, chunk_bytes=1024, prepare=fresh, workers=3) as pipe:
        list(pipe.map(range(5)))
    assert len(copies) == 5  # a prepare returning its own array is copied in as before
    assert dev.live().total == 0


def test_outside_a_prepare_it_is_an_ordinary_array():
    a = rf.host.empty_slot((2, 3), "int16")
    assert a.shape == (2, 3) and a.dtype == np.int16 and a.flags.c_contiguous and a.flags.owndata
    assert rf.host.buffer(a) is None
    assert rf.host.empty_slot(4).shape == (4,)


def test_only_the_first_call_gets_the_slot_and_a_too_large_one_is_refused_by_the_stage(copies):
    seen = []

    def two(i):
        a = rf.host.empty_slot(8, np.float32)
        b = rf.host.empty_slot(8, np.float32)
        seen.append(np.shares_memory(a, b))
        a[:] = i
        b[:] = -1
        return a

    with rf.Pipeline(double_plus_one, device=rf.device("sim", checked=True), chunk_bytes=256, prepare=two) as pipe:
        np.testing.assert_array_equal(pipe.submit(3).result(), np.full(8, 7, np.float32))
    assert seen == [False] and copies == []

    def large(i):
        return rf.host.empty_slot(1000, np.float32)  # 4000 bytes: more than a slot, a new array

    with rf.Pipeline(double_plus_one, device=rf.device("sim"), chunk_bytes=256, prepare=large) as pipe:
        with pytest.raises(rf.StageError) as info:
            pipe.submit(0).result()
    assert "does not fit a slot of 256 bytes" in str(info.value.__cause__)


def test_a_slot_array_among_several_returned_arrays_is_not_overwritten():
    """Packing a tuple writes the slot from its first byte: an array made there must not be
    clobbered by the arrays packed before it."""

    def pair(i):
        a = rf.host.empty_slot(16, np.float32)
        a[:] = i
        return (np.full(16, -i, np.float32), a)

    def f(x, y):
        y[0][:] = x[0]
        y[1][:] = x[1]

    with rf.Pipeline(f, device=rf.device("sim", checked=True, chaos=True, seed=3), chunk_bytes=1024, prepare=pair,
                     checked=True) as pipe:
        out = list(pipe.map(range(12)))
    for i, (neg, pos) in enumerate(out):
        np.testing.assert_array_equal(neg, np.full(16, -i, np.float32))
        np.testing.assert_array_equal(pos, np.full(16, i, np.float32))


def test_in_worker_processes_the_slot_is_the_shared_pinned_block():
    with rf.Pipeline(double_plus_one, device=rf.device("sim", checked=True), chunk_bytes=1024,
                     prepare=pp.ramp_in_slot, processes=True, workers=2) as pipe:
        out = list(pipe.map(range(30)))
    for i, r in enumerate(out):
        np.testing.assert_array_equal(r, pp.ramp(i) * 2 + 1)


@pytest.mark.parametrize("shape, dtype, error, match", [
    ((-1, 3), "f4", ValueError, "empty_slot: shape \\(-1, 3\\) has a negative dimension"),
    ("3", "f4", TypeError, "empty_slot: shape must be an int"),
    ((2, 2), object, TypeError, "empty_slot: .*Python objects"),
    ((3,), "no such dtype", TypeError, "empty_slot"),
    # more bytes than numpy can address: numpy's own words named neither the call nor the fix
    ((1 << 62,), "f8", ValueError, r"empty_slot\(shape=\(4611686018427387904,\), dtype=float64\): 36893488147419103232 "
                                   r"bytes, more than numpy can make .*; ask for a smaller shape"),
    ((1 << 32, 1 << 32), "u1", ValueError, r"empty_slot\(shape=\(4294967296, 4294967296\), dtype=uint8\)"),
])
def test_bad_shapes_and_dtypes_name_empty_slot(shape, dtype, error, match):
    with pytest.raises(error, match=match):
        rf.host.empty_slot(shape, dtype)


def test_the_offer_ends_when_prepare_raises_any_exception():
    from ringflow._pipeline.slot_array import run_offering

    raw = np.zeros(256, np.uint8)

    def interrupted(i):
        rf.host.empty_slot(4, np.float32)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_offering(interrupted, 0, raw)
    assert not np.shares_memory(rf.host.empty_slot(4, np.float32), raw)

    def untouched(i):
        raise ValueError("bad item")

    with pytest.raises(ValueError):
        run_offering(untouched, 0, raw)
    assert not np.shares_memory(rf.host.empty_slot(4, np.float32), raw)


def test_prepares_on_many_threads_each_get_their_own_slot():
    """Every worker thread's offer is its own: eight workers making arrays in their slots at once
    deliver every item exact under chaos (a shared offer would hand two items one slot)."""
    dev = rf.device("sim", chaos=True, seed=11, checked=True)
    with rf.Pipeline(double_plus_one, device=dev, chunk_bytes=1024, prepare=in_slot, workers=8,
                     checked=True) as pipe:
        out = list(pipe.map(range(200)))
    for i, r in enumerate(out):
        np.testing.assert_array_equal(r, np.full((i % 13 + 1, 3), 2 * i + 1, np.float32))


def test_an_offer_inside_another_on_one_thread_leaves_the_outer_one_standing():
    from ringflow._pipeline.slot_array import run_offering

    outer_raw, inner_raw = np.zeros(64, np.uint8), np.zeros(64, np.uint8)

    def inner(i):
        return rf.host.empty_slot(4, np.float32)

    def outer(i):
        a = run_offering(inner, i, inner_raw)
        b = rf.host.empty_slot(4, np.float32)
        return a, b

    a, b = run_offering(outer, 0, outer_raw)
    assert np.shares_memory(a, inner_raw) and np.shares_memory(b, outer_raw)
    assert not np.shares_memory(rf.host.empty_slot(4, np.float32), outer_raw)


def test_an_array_in_another_items_slot_fails_its_item_instead_of_sending_that_items_data():
    """A prepare on a worker thread returned an array from an earlier prepare's empty_slot, kept
    past its return: it lies in the pinned host-in ring, in the slot of whatever item that slot
    holds now, and was copied from there: the item came back with another item's data, and no
    one was told. Such an item fails saying why; one that lands in that same slot again is its
    own data (used in place, no copy)."""
    kept = {}

    def keeps_its_first_slot(i):
        out = rf.host.empty_slot((8,), np.float32)
        out[:] = i
        return kept.setdefault("first", out)

    dev = rf.device("sim", checked=True)
    with rf.Pipeline(double_plus_one, device=dev, chunk_bytes=4096, prepare=keeps_its_first_slot, workers=1,
                     on_error="continue", checked=True) as pipe:
        check_kept_slot_items(pipe, 16, lambda i, y: np.testing.assert_array_equal(
            y, np.full(8, 2 * i + 1, np.float32), err_msg=str(i)))
    assert dev.live().total == 0


def test_arrays_in_another_items_slot_among_several_returned_arrays_fail_their_item():
    """The same for a prepare returning a tuple: a kept slot array among its arrays fails the
    item, not packed from another item's slot."""
    kept = {}

    def pair(i):
        out = rf.host.empty_slot((8,), np.float32)
        out[:] = i
        return (np.full(4, -i, np.float32), kept.setdefault("first", out))

    def f(x, y):
        y[0][:] = x[0]
        y[1][:] = x[1]

    def check(i, result):
        neg, pos = result
        np.testing.assert_array_equal(neg, np.full(4, -i, np.float32), err_msg=str(i))
        np.testing.assert_array_equal(pos, np.full(8, i, np.float32), err_msg=str(i))

    dev = rf.device("sim", checked=True)
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, prepare=pair, workers=1, on_error="continue",
                     checked=True) as pipe:
        check_kept_slot_items(pipe, 16, check)
    assert dev.live().total == 0
