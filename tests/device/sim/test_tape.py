"""What a launched callable does to its arrays, recorded while capturing and replayed by each
graph launch (``ringflow._device.sim.tape``): every replay computes what the callable computes
on that launch's data, without calling it; what needs the data on the host, or a result sized
by the data, abandons the capture, as a GPU's synchronisation would, and so does a new array (a
temporary), as a GPU's allocation would. The replayed computes write with ``out=``, in place,
or into views and scratch arrays made outside them."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest

import ringflow as rf
from ringflow._errors import CaptureError, LaunchError

ROWS, COLS = 12, 5
WEIGHTS = np.random.default_rng(9).uniform(-1, 1, (COLS, 3)).astype(np.float32)
TABLE = np.arange(10, dtype=np.float32) ** 2
SCALE = rf.Kernel('extern "C" __global__ void scale(const float* x, float* y, float a, size_t n) {}', "scale",
                  reference=lambda x, y, a: np.multiply(x, a, out=y))


# scratch memory made outside the callables (as device arrays would be on a GPU): a captured
# callable writes with out= or in place, since a temporary is an allocation a capture refuses
MASK = np.zeros((ROWS, COLS), bool)
MEANS = np.zeros(COLS, np.float64)
INDICES = np.zeros((ROWS, COLS), np.intp)


def _operators(x, y):
    np.negative(x, out=y)
    y *= 3
    y += 1 ** 2


def _where_and_clip(x, y):
    np.greater(x, 0.5, out=MASK)
    np.negative(x, out=y)
    np.clip(x, 0.6, 0.9, out=y, where=MASK)


def _rows_reduced(x, y):
    x.sum(axis=1, dtype=np.float64, out=y[:, 0])
    x.max(axis=1, out=y[:, 1])
    np.mean(x, axis=0, dtype=np.float64, out=MEANS)
    y[:, 2:] = MEANS[:3]


def _sort_cumsum_concatenate(x, y):
    np.cumsum(x, axis=1, out=y)
    np.concatenate([x[:, 1:2], x[:, :1]], axis=1, out=y[:, :2])
    y[:, :2].sort(axis=1)


def _iterated(x, y):
    for i, row in enumerate(x):
        y[i] = row[::-1]


def _divmod(x, y):
    np.divmod(x, 0.3, out=(x, y))
    x *= 10
    y += x


def _gather(x, y):
    np.multiply(x, 10, out=INDICES, casting="unsafe")  # (x in [0, 1): flat indices 0 to 9)
    np.take(x, INDICES, out=y)
    np.add(y, x.reshape(-1)[7], out=y)


def _in_place(x, y):
    x += 1
    x *= x
    np.add(x, 1, out=y)
    y -= x.T.T


def _kernel(x, y):
    SCALE(x.reshape(-1), y.reshape(-1), np.float32(2.5))
    y += 1


def _scalars(x, y):
    np.minimum(x, x[0, 0], out=y)
    y /= x[-1, -1]
    np.multiply(y, x[1, 2], out=y)


COMPUTES = {
    "operators": _operators,
    "ufunc out=": lambda x, y: np.multiply(x, 2, out=y),
    "where= and clip": _where_and_clip,
    "reductions": _rows_reduced,
    "matmul with host weights": lambda x, y: np.matmul(x, WEIGHTS, out=y[:, :3]),
    "sort, cumsum, concatenate": _sort_cumsum_concatenate,
    "methods": lambda x, y: (y.fill(0), y.T[0].__setitem__(Ellipsis, x.ravel()[:ROWS]), y.clip(0.2, 0.7, out=y)),
    "indexing": lambda x, y: (y.__setitem__(slice(None, None, 2), x[::2, ::-1]),
                              y.__setitem__([11, 9, 7, 5, 3, 1], x[1::2])),
    "mask assignment": lambda x, y: (np.copyto(y, x), np.greater(x, 0.5, out=MASK), y.__setitem__(MASK, 0)),
    "iteration": _iterated,
    "divmod": _divmod,
    "gather": _gather,
    "in place": _in_place,
    "a kernel": _kernel,
    "numpy scalars": _scalars,
}


def capture(fn, arrays, *, seed=0):
    """A sim device with a device buffer per array in ``arrays`` and a graph that copies them in,
    launches ``fn`` on them and copies them back out; returns (graph, stream, host_in, host_out)."""
    dev = rf.device("sim", seed=seed, chaos=True)
    a = dev.create_stream()
    hosts = [dev.allocate_host(arr.nbytes) for arr in arrays]
    outs = [dev.allocate_host(arr.nbytes) for arr in arrays]
    devs = [dev.allocate(arr.nbytes) for arr in arrays]
    a.begin_capture()
    for h, d in zip(hosts, devs):
        a.copy(d, h)
    a.launch(fn, *[d.array(arr.dtype, arr.shape) for d, arr in zip(devs, arrays)])
    for o, d in zip(outs, devs):
        a.copy(o, d)
    return a.end_capture(), a, hosts, outs


def launch(graph, a, hosts, outs, arrays):
    for h, arr in zip(hosts, arrays):
        h.view(arr.dtype)[:] = arr.reshape(-1)
    graph.launch(a)
    a.sync()
    return [o.view(arr.dtype).reshape(arr.shape) for o, arr in zip(outs, arrays)]


def check_launches_compute_as(fn, shape, calls: int) -> None:
    """``fn(x, y)`` captured over float32 arrays of ``shape``, then launched ``calls`` times on new
    data: each launch leaves in both arrays what ``fn`` itself makes of that data."""
    x = np.zeros(shape, np.float32)
    graph, a, hosts, outs = capture(fn, [x, x])
    for call in range(calls):
        x = np.random.default_rng(call).uniform(size=shape).astype(np.float32)
        y = np.random.default_rng(100 + call).uniform(size=shape).astype(np.float32)
        got = launch(graph, a, hosts, outs, [x, y])
        want_x, want_y = x.copy(), y.copy()
        fn(want_x, want_y)
        np.testing.assert_array_equal(got[0], want_x)
        np.testing.assert_array_equal(got[1], want_y)


@pytest.mark.parametrize("name", sorted(COMPUTES))
def test_each_launch_computes_what_the_callable_computes_on_its_data(name):
    check_launches_compute_as(COMPUTES[name], (ROWS, COLS), calls=3)


def test_a_host_array_the_callable_holds_is_used_as_it_is_at_each_launch():
    """A numpy array from outside the callable stands for device memory made outside it, as a
    CuPy array would on a GPU: scratch memory written and read back, weights changed between
    launches. Only the host values the callable reads itself (here a scale) are frozen."""
    scratch = np.zeros(ROWS * COLS, np.float32)
    weights = np.ones(ROWS * COLS, np.float32)
    scale = [2.0]

    def fn(x):
        flat = x.reshape(-1)
        np.multiply(flat, weights, out=scratch)
        np.add(scratch, scale[0], out=flat)

    x = np.zeros((ROWS, COLS), np.float32)
    graph, a, hosts, outs = capture(fn, [x])
    assert not scratch.any()  # capturing ran nothing on the caller's arrays
    for call in range(3):
        weights[:] = call + 1
        scale[0] = 10.0  # too late: read while captured
        x = np.random.default_rng(call).uniform(size=(ROWS, COLS)).astype(np.float32)
        (got,) = launch(graph, a, hosts, outs, [x])
        np.testing.assert_array_equal(got, x * np.float32(call + 1) + np.float32(2))
        np.testing.assert_array_equal(scratch, (x * np.float32(call + 1)).reshape(-1))


@pytest.mark.parametrize("fn, match", [
    (lambda x: x[x > 0.5], "boolean mask"),
    (lambda x: np.nonzero(x), "size depends on the data"),
    (lambda x: x.nonzero(), "size depends on the data"),
    (lambda x: np.unique(x), "size depends on the data"),
    (lambda x: x[:x.argmax()], "slice bound"),
    (lambda x: np.zeros(x.argmax()), "an index or a size"),
    (lambda x: TABLE[(x * 10).astype(np.intp) % 10], "a host array indexed by device data"),
    (lambda x: np.allclose(x, 1), "gave the host a bool"),
    (lambda x: x in x, "membership"),
    # writing the data out hands it to the host (the stand-in's shadow holds zeros, not the data)
    (lambda x: np.save(io.BytesIO(), x), r"np.save, which writes the data out"),
    (lambda x: np.savez(io.BytesIO(), a=x), r"np.savez, which writes the data out"),
    (lambda x: np.savez_compressed(io.BytesIO(), x), r"np.savez_compressed, which writes the data out"),
    (lambda x: np.savetxt(io.StringIO(), x), r"np.savetxt, which writes the data out"),
    (lambda x: pickle.dumps(x), "pickling"),
    (lambda x: pickle.dumps([x], protocol=2), "pickling"),
])
def test_what_needs_the_data_on_the_host_abandons_the_capture(fn, match):
    dev = rf.device("sim")
    a, d = dev.create_stream(), dev.allocate(4 * ROWS)
    a.begin_capture()
    with pytest.raises(CaptureError, match=match):
        a.launch(fn, d.array(np.float32, ROWS))
    with pytest.raises(CaptureError, match="abandoned"):
        a.end_capture()


def test_the_capture_is_abandoned_even_where_the_callable_catches_the_refusal():
    def fn(x):
        try:
            return float(x.sum())
        except Exception:  # noqa: BLE001 - a GPU's capture is invalidated all the same
            x *= 2

    dev = rf.device("sim")
    a, d = dev.create_stream(), dev.allocate(4 * ROWS)
    a.begin_capture()
    with pytest.raises(CaptureError, match=r"float\(\)"):
        a.launch(fn, d.array(np.float32, ROWS))
    with pytest.raises(CaptureError, match="abandoned"):
        a.end_capture()


def test_a_result_sized_by_host_values_changed_since_the_capture_fails_the_launch():
    shape = np.array([ROWS, 1])

    def fn(x):
        view = x.reshape(shape)
        view += 1

    x = np.zeros(ROWS, np.float32)
    graph, a, hosts, outs = capture(fn, [x])
    launch(graph, a, hosts, outs, [x])
    shape[...] = [2, ROWS // 2]
    with pytest.raises(LaunchError, match="size depends on the data"):
        launch(graph, a, hosts, outs, [x])


def test_a_stand_in_kept_past_the_capture_is_refused():
    kept = []
    dev = rf.device("sim")
    a, d = dev.create_stream(), dev.allocate(4 * ROWS)
    a.begin_capture()
    a.launch(kept.append, d.array(np.float32, ROWS))
    a.end_capture()
    (x,) = kept
    assert x.shape == (ROWS,) and x.dtype == np.float32 and "captured launch" in repr(x)
    with pytest.raises(CaptureError, match="kept past the capture"):
        x + 1


@pytest.mark.parametrize("read", [np.asarray, float, int, bool, complex, str, "{}".format, pickle.dumps,
                                  lambda x: 1 in x, lambda x: [0][x]])
def test_a_stand_in_kept_past_the_capture_and_read_on_the_host_is_refused_as_kept(read):
    kept = []
    dev = rf.device("sim")
    a, d = dev.create_stream(), dev.allocate(4)
    a.begin_capture()
    a.launch(kept.append, d.array(np.float32, 1))
    a.end_capture()
    with pytest.raises(CaptureError, match="kept past the capture"):
        read(kept[0])


def test_a_read_only_argument_refuses_a_write_while_captured():
    dev = rf.device("sim")
    a, d, e = dev.create_stream(), dev.allocate(4 * ROWS), dev.allocate(4 * ROWS)
    x, y = d.array(np.float32, ROWS), e.array(np.float32, ROWS)
    a.begin_capture()
    with pytest.raises(ValueError, match="read-only"):
        a.launch(lambda x, y: x.__iadd__(1), x, y, reads=[x], writes=[y])
    a.abort_capture()


@pytest.mark.parametrize("fn, match", [
    pytest.param(lambda x, y: y.__setitem__(Ellipsis, x * 2 + 1), r"np\.multiply made a new shape \(12,\) float32 array",
                 id="an operator"),
    pytest.param(lambda x, y: np.sqrt(x), r"np\.sqrt made a new", id="a ufunc without out="),
    pytest.param(lambda x, y: np.add(x, 1, out=y) - 1, r"np\.subtract made a new", id="an operator on out="),
    pytest.param(lambda x, y: np.copyto(y, x.copy()), r"x\.copy\(\) made a new", id="copy"),
    pytest.param(lambda x, y: np.copyto(y, x.astype(np.float64)),
                 r"x\.astype\(\) made a new shape \(12,\) float64 array", id="astype"),
    pytest.param(lambda x, y: y.__setitem__(0, x.sum()), r"x\.sum\(\) made a new shape \(\) float32 array",
                 id="a reduction to a scalar"),
    pytest.param(lambda x, y: np.copyto(y[:2], x[[1, 0]]), r"indexing with an array made a new", id="a gather"),
    pytest.param(lambda x, y: np.copyto(y, np.where(y > 0, x, 0)), r"np\.greater made a new", id="np.where"),
    pytest.param(lambda x, y: np.copyto(y, np.concatenate([x[:6], x[6:]])), r"np\.concatenate made a new",
                 id="a numpy function"),
    pytest.param(lambda x, y: np.copyto(y, x.reshape(3, 4).T.reshape(-1)), r"x\.reshape\(\) made a new",
                 id="a reshape that copies"),
    pytest.param(lambda x, y: np.divmod(x, 0.5, out=(y, None)), r"np\.divmod made a new", id="one of two outputs"),
    pytest.param(lambda x, y: np.add(y, copy.copy(y), out=y), r"copy\.copy\(\) made a new shape \(12,\) float32",
                 id="copy.copy"),
    pytest.param(lambda x, y: np.add(x, copy.deepcopy(x), out=y), r"copy\.deepcopy\(\) made a new", id="copy.deepcopy"),
])
def test_a_new_device_array_made_while_captured_abandons_the_capture(fn, match):
    """A temporary is device memory the framework's allocator hands out while the stream
    captures, which a GPU's capture refuses: the launch raises once the callable returns (what it
    did meanwhile runs nowhere), naming the first new array and how to write without it."""
    dev = rf.device("sim")
    a, d, e = dev.create_stream(), dev.allocate(4 * ROWS), dev.allocate(4 * ROWS)
    a.begin_capture()
    with pytest.raises(CaptureError, match=r"allocated device memory while captured: " + match) as info:
        a.launch(fn, d.array(np.float32, ROWS), e.array(np.float32, ROWS))
    assert "out=" in str(info.value) and "in place" in str(info.value)
    with pytest.raises(CaptureError, match="abandoned: .* allocated device memory"):
        a.end_capture()


def test_writes_into_existing_arrays_and_views_of_them_allocate_nothing():
    """What a GPU captures: ufuncs with ``out=``, in-place operators, assignments and copies into
    an array, views (slices, a transpose, a reshape that keeps the layout, a same-type astype),
    in-place methods and ``rf.Kernel`` calls, also into a scratch array made outside the callable."""
    scratch = np.zeros(ROWS, np.float32)

    def fn(x, y):
        np.multiply(x, 2, out=y)
        y += 1
        y[...] = x
        y[:] = x[::-1]
        np.copyto(y[:6], x.reshape(2, 6).T.T[0])
        y.reshape(3, 4)[...] = x.reshape(4, 3).T
        np.add(x[2], y[3], out=y[4:5])
        np.sqrt(y, out=scratch)
        np.maximum(scratch, x.astype(np.float32, copy=False), out=y)
        y.sort()
        SCALE(x, y, np.float32(0.5))
        np.add.at(y, [0, 1], x[:2])
        for row in y.reshape(3, 4):
            row *= 2

    check_launches_compute_as(fn, ROWS, calls=2)


def test_a_host_read_after_a_new_array_is_the_reason_given():
    """As on a GPU, where the synchronisation fails inside the callable and the allocations are
    counted after it returns: ``float(x.max())`` is refused for reading the data on the host."""
    dev = rf.device("sim")
    a, d = dev.create_stream(), dev.allocate(4 * ROWS)
    a.begin_capture()
    with pytest.raises(CaptureError, match=r"read device data on the host while captured: float\(\)"):
        a.launch(lambda x: float(x.max()), d.array(np.float32, ROWS))
    with pytest.raises(CaptureError, match=r"abandoned: .*float\(\)"):
        a.end_capture()


def test_a_named_tuple_of_new_arrays_reaches_the_callable_and_abandons_the_capture():
    """np.linalg's results are new arrays (a GPU's solver allocates them): the callable sees
    the named tuple of stand-ins while captured, and the capture is abandoned when it returns."""
    seen = []

    def fn(x, y):
        np.matmul(x[:5], x[:5].T, out=y[:5, :5])
        result = np.linalg.eigh(y[:5, :5])
        seen.append((type(result).__name__, result.eigenvalues.shape, result.eigenvectors.shape))
        w, v = result
        y[:5, :5] = v * w

    dev = rf.device("sim")
    a, d, e = dev.create_stream(), dev.allocate(4 * ROWS * COLS), dev.allocate(4 * ROWS * COLS)
    a.begin_capture()
    with pytest.raises(CaptureError, match=r"allocated device memory while captured: np\.eigh made a new"):
        a.launch(fn, d.array(np.float32, (ROWS, COLS)), e.array(np.float32, (ROWS, COLS)))
    assert seen == [("EighResult", (5,), (5, 5))]
    a.abort_capture()
