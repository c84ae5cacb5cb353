"""``Pipeline(fill="rows")``: outputs whose size only the compute knows; only the rows it filled
come back."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from tests.helpers.sim import read_on


def positives(x, y):
    """The positive values of ``x``, in order, at the start of ``y``; returns how many."""
    keep = x[x > 0]
    y[:keep.size] = keep
    return int(keep.size)


positives.sim_seconds = 20e-6


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 400), min_size=1, max_size=12), seed=st.integers(0, 2 ** 16),
       pooled=st.booleans())
def test_only_the_filled_rows_come_back(sizes, seed, pooled):
    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    if not pooled:
        rf.host.set_budget(1, device=dev)  # results through the host-out ring
    rng = np.random.default_rng(seed)
    items = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    with rf.Pipeline(positives, device=dev, chunk_bytes=4096, fill="rows", checked=True) as pipe:
        out = list(pipe.map(items))
    for a, r in zip(items, out, strict=True):
        np.testing.assert_array_equal(r, a[a > 0])
        assert r.dtype == np.float32


def test_fill_with_an_output_spec_and_on_the_device():
    dev = rf.device("sim", seed=2)

    def evens(x, y):
        keep = x[x % 2 == 0]
        y[:keep.size] = keep
        return keep.size

    item = np.arange(20, dtype=np.int64)
    with rf.Pipeline(evens, device=dev, chunk_bytes=4096, fill="rows", output=((20,), "int64")) as pipe:
        np.testing.assert_array_equal(pipe.submit(item).result(), np.arange(0, 20, 2))
        none = pipe.submit(np.array([1, 3, 5], np.int64)).result()  # nothing kept: no bytes come back
        assert none.shape == (0,) and none.dtype == np.int64
    user = dev.create_stream()
    with rf.Pipeline(evens, device=dev, chunk_bytes=4096, fill="rows", deliver="device") as pipe:
        res = pipe.submit(item).result()
        assert res.shape == (10,)
        got = read_on(user, res)
        res.release(stream=user)
        user.sync()
    np.testing.assert_array_equal(got, np.arange(0, 20, 2))
    user.close()


@pytest.mark.parametrize("returned", [None, -1, 11, "3", 2.0, True])
def test_a_compute_that_does_not_return_a_row_count_fails_its_chunk_by_name(returned):
    def bad(x, y):
        y[...] = x
        return returned

    with rf.Pipeline(bad, device=rf.device("sim"), chunk_bytes=4096, fill="rows", on_error="continue") as pipe:
        fut = pipe.submit(np.ones(10, np.float32))
        err = fut.exception()
        ok = pipe.submit(np.ones(10, np.float32))
    assert isinstance(err, rf.StageError) and err.stage == "compute"
    assert "fill='rows'" in str(err.__cause__) and "an int from 0 to 10" in str(err.__cause__)
    assert ok.exception() is not None and pipe.stats().in_flight == 0


class _UnshowableCount(int):
    def __repr__(self):
        raise RuntimeError("no repr")


class _UncomparableCount(int):
    def __ge__(self, other):
        raise RuntimeError("no comparison")

    __le__ = __gt__ = __lt__ = __ge__

    def __repr__(self):
        return "_UncomparableCount()"


@pytest.mark.parametrize("returned", [_UnshowableCount(11), _UncomparableCount(11)],
                         ids=["repr-raises", "compare-raises"])
def test_a_row_count_of_a_hostile_int_subclass_fails_its_chunk_not_the_pipeline(returned):
    """What the compute returns is the user's object: reading it as a row count runs none of its
    code on the progress thread (a ``__repr__`` or comparison that raises there ended the
    pipeline, "a ringflow bug"). It fails its chunk like any count that is not an int in range;
    the next item runs."""
    def bad(x, y):
        y[...] = x
        return returned if x[0] == 1 else 2

    with rf.Pipeline(bad, device=rf.device("sim"), chunk_bytes=4096, fill="rows", on_error="continue") as pipe:
        err = pipe.submit(np.ones(10, np.float32)).exception(timeout=10)
        ok = pipe.submit(np.zeros(10, np.float32)).result(timeout=10)
    assert isinstance(err, rf.StageError) and err.stage == "compute"
    assert "fill='rows'" in str(err.__cause__) and "an int from 0 to 10" in str(err.__cause__)
    assert ok.shape == (2,) and pipe.stats().failed == 1


def test_a_row_count_returned_as_a_0d_array_is_refused_with_what_to_return_instead():
    """A count computed on the device (``(x > 0).sum()`` with CuPy or torch) is a 0-d array, a
    device scalar, not an int: reading it would wait for the kernel on the progress thread. The
    error says to return ``int(...)`` of it."""
    def counted(x, y):
        y[...] = x
        return np.array(3)  # a 0-d array, as CuPy's and torch's sums are

    class NoShape:
        @property
        def shape(self):
            raise RuntimeError("no shape")

    def unshaped(x, y):
        y[...] = x
        return NoShape()

    with rf.Pipeline(counted, device=rf.device("sim"), chunk_bytes=4096, fill="rows", on_error="continue") as pipe:
        err = pipe.submit(np.ones(10, np.float32)).exception(timeout=10)
    assert isinstance(err, rf.StageError) and err.stage == "compute"
    assert "a 0-d array is not a count: return int(...) of it" in str(err.__cause__), err.__cause__
    with rf.Pipeline(unshaped, device=rf.device("sim"), chunk_bytes=4096, fill="rows", on_error="continue") as pipe:
        err = pipe.submit(np.ones(10, np.float32)).exception(timeout=10)  # its shape is not read past the raise
    assert isinstance(err, rf.StageError) and "0-d" not in str(err.__cause__), err.__cause__


def test_bad_fill_options_are_refused():
    with pytest.raises(ValueError, match="fill"):
        rf.Pipeline(positives, device=rf.device("sim"), chunk_bytes=4096, fill="bytes")
    with pytest.raises(ValueError, match="fill='rows' needs a result of one array.*; output is a tuple, list or dict"):
        rf.Pipeline(positives, device=rf.device("sim"), chunk_bytes=4096, fill="rows",
                    output={"a": ((4,), "f4"), "b": ((4,), "f4")})


@pytest.mark.parametrize("spec", [{"a": ((4, 2), "f4")}, (((4, 2), "f4"), ((4,), "i8"))], ids=["dict", "tuple"])
def test_an_output_function_giving_several_arrays_is_refused_at_submit_naming_output_and_fill(spec):
    """As a fixed spec of several arrays is refused when the pipeline is made, one that
    output(item) gives is refused when the item is offered, before anything of it is accepted."""
    def keep_two(x, y):
        y[:2] = x[:2]
        return 2

    dev = rf.device("sim")
    several = r"fill='rows' needs a result of one array.*output\(item\) is a tuple, list or dict"
    with rf.Pipeline(keep_two, device=dev, chunk_bytes=4096, fill="rows",
                     output=lambda item: spec if item.shape == (4, 2) else (item.shape, item.dtype)) as pipe:
        with pytest.raises(ValueError, match=several):
            pipe.submit(np.ones((4, 2), np.float32))
        assert pipe.stats().accepted == 0
        with pytest.raises(ValueError, match=several):
            list(pipe.map([np.ones((3, 2), np.float32), np.ones((4, 2), np.float32)]))
        np.testing.assert_array_equal(pipe.submit(np.ones((3, 2), np.float32)).result(timeout=30), np.ones((2, 2)))
    assert pipe.stats().in_flight == 0 and pipe.stats().failed == 0
    gc.collect()
    assert dev.live().total == 0, f"left live: {dev.live()}"


def _copy_rows(x, y):
    y[...] = x
    return len(x)


@pytest.mark.parametrize("item", [(np.arange(3.0), np.arange(3.0)), [np.arange(3.0)], {"a": np.arange(3.0)},
                                  np.array(1.0)], ids=["tuple", "list", "dict", "0-d"])
def test_an_item_that_has_no_rows_to_fill_is_refused_at_submit(item):
    """fill='rows' counts the rows along one array's first axis: several arrays, or a 0-d one,
    are refused when offered (naming why), not failed later in ringflow's own consumer."""
    with rf.Pipeline(_copy_rows, device=rf.device("sim"), chunk_bytes=4096, fill="rows") as pipe:
        with pytest.raises(ValueError, match="fill='rows' needs items (of one array|with rows)"):
            pipe.submit(item)
        np.testing.assert_array_equal(pipe.submit(np.arange(4.0)).result(timeout=30), np.arange(4.0))


def test_a_prepared_result_that_has_no_rows_to_fill_fails_that_item_naming_why():
    with rf.Pipeline(_copy_rows, device=rf.device("sim"), chunk_bytes=4096, fill="rows", on_error="continue",
                     prepare=lambda i: (np.arange(3.0), np.arange(3.0)) if i == 1 else np.arange(3.0) + i) as pipe:
        with pytest.raises(rf.StageError, match="prepare.*fill='rows' needs items of one array"):
            pipe.submit(1).result(timeout=30)
        np.testing.assert_array_equal(pipe.submit(2).result(timeout=30), np.arange(3.0) + 2)


def _no_rows(x, y):
    return 0


def _copied(x, y):
    y[...] = x


def test_a_0d_output_spec_is_refused_when_the_pipeline_is_made():
    """A 0-d output has no rows to count: a fixed spec is refused by name when the pipeline is
    made (it used to kill the progress thread with an IndexError once a compute returned 0)."""
    with pytest.raises(ValueError, match=r"fill='rows' needs a result with rows.*output is 0-d"):
        rf.Pipeline(_no_rows, device=rf.device("sim"), chunk_bytes=4096, fill="rows", output=((), "f4"))


def test_a_0d_output_from_the_output_function_is_refused_at_submit():
    dev = rf.device("sim")
    with rf.Pipeline(_no_rows, device=dev, chunk_bytes=4096, fill="rows",
                     output=lambda item: ((), "f4") if item.size == 1 else (item.shape, item.dtype)) as pipe:
        with pytest.raises(ValueError, match=r"fill='rows' needs a result with rows.*output\(item\) is 0-d"):
            pipe.submit(np.ones(1, np.float32))
        assert pipe.stats().accepted == 0
        assert pipe.submit(np.ones(3, np.float32)).result(timeout=30).shape == (0,)
    assert pipe.stats().failed == 0
    gc.collect()
    assert dev.live().total == 0, f"left live: {dev.live()}"


def test_a_0d_device_array_item_is_refused_at_submit():
    """A device array item (another pipeline's result left on the device) is checked as a host
    one is: a 0-d one has no rows to fill."""
    dev = rf.device("sim")
    with rf.Pipeline(_copied, device=dev, chunk_bytes=4096, deliver="device") as source:
        held = source.submit(np.array(2.0)).result(timeout=30)
        with rf.Pipeline(_no_rows, device=dev, chunk_bytes=4096, fill="rows") as pipe:
            with pytest.raises(ValueError, match="fill='rows' needs items with rows"):
                pipe.submit(held.array)
            assert pipe.stats().accepted == 0
        held.release()
    gc.collect()
    assert dev.live().total == 0, f"left live: {dev.live()}"
