"""What a launched callable does to its arrays, recorded while capturing and replayed by each
graph launch (``ringflow._device.sim.tape``): every replay computes what the callable computes
on that launch's data, without calling it; what needs the data on the host, or a result sized
by the data, abandons the capture, as a GPU's synchronisation would."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from ringflow._errors import CaptureError, LaunchError

ROWS, COLS = 12, 5
WEIGHTS = np.random.default_rng(9).uniform(-1, 1, (COLS, 3)).astype(np.float32)
TABLE = np.arange(10, dtype=np.float32) ** 2
SCALE = rf.Kernel('extern "C" __global__ void scale(const float* x, float* y, float a, size_t n) {}', "scale",
                  reference=lambda x, y, a: np.multiply(x, a, out=y))


def _rows_reduced(x, y):
    y[:, 0] = x.sum(axis=1, dtype=np.float64)
    y[:, 1] = x.max(axis=1)
    y[:, 2:] = x.astype(np.float64).mean(axis=0)[:3]


def _iterated(x, y):
    for i, row in enumerate(x):
        y[i] = row[::-1]


def _divmod(x, y):
    q, r = np.divmod(x, 0.3)
    y[...] = q * 10 + r


def _gather(x, y):
    idx = (x * 10).astype(np.intp) % 10
    y[...] = x.reshape(-1)[idx] + np.take(x, idx)


def _in_place(x, y):
    x += 1
    x *= x
    np.add(x, 1, out=y)
    y -= x.T.T


def _kernel(x, y):
    SCALE(x.reshape(-1), y.reshape(-1), np.float32(2.5))
    y += 1


def _named_tuple(x, y):
    w, v = np.linalg.eigh(x[:5] @ x[:5].T)
    y[:5] = v * w


def _scalars(x, y):
    s = x.max()
    y[...] = np.minimum(x, s * 0.5) / x.sum()


COMPUTES = {
    "operators": lambda x, y: y.__setitem__(Ellipsis, -x * 3 + 1 ** 2),
    "ufunc out=": lambda x, y: np.multiply(x, 2, out=y),
    "where and clip": lambda x, y: np.copyto(y, np.where(x > 0.5, np.clip(x, 0.6, 0.9), -x)),
    "reductions": _rows_reduced,
    "matmul with host weights": lambda x, y: y[:, :3].__setitem__(Ellipsis, x @ WEIGHTS),
    "sort, cumsum, concatenate": lambda x, y: np.copyto(
        y, np.concatenate([np.sort(x, axis=1)[:, :2], np.cumsum(x, axis=1)[:, 2:]], axis=1)),
    "methods": lambda x, y: (y.fill(0), y.__setitem__((slice(None), 0), x.T.copy().ravel()[:ROWS])),
    "indexing": lambda x, y: (y.__setitem__(slice(None, None, 2), x[::2, ::-1]),
                              y.__setitem__(slice(1, None, 2), x[[1, 0, 3, 2, 5, 4], :])),
    "mask assignment": lambda x, y: (np.copyto(y, x), y.__setitem__(x > 0.5, 0)),
    "iteration": _iterated,
    "divmod": _divmod,
    "gather": _gather,
    "in place": _in_place,
    "a kernel": _kernel,
    "numpy scalars": _scalars,
    "a named tuple (np.linalg)": _named_tuple,
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


@pytest.mark.parametrize("name", sorted(COMPUTES))
def test_each_launch_computes_what_the_callable_computes_on_its_data(name):
    fn = COMPUTES[name]
    x = np.zeros((ROWS, COLS), np.float32)
    graph, a, hosts, outs = capture(fn, [x, x])
    for call in range(3):
        x = np.random.default_rng(call).uniform(size=(ROWS, COLS)).astype(np.float32)
        y = np.random.default_rng(100 + call).uniform(size=(ROWS, COLS)).astype(np.float32)
        got = launch(graph, a, hosts, outs, [x, y])
        want_x, want_y = x.copy(), y.copy()
        fn(want_x, want_y)
        np.testing.assert_array_equal(got[0], want_x)
        np.testing.assert_array_equal(got[1], want_y)


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
    counts = np.ones(ROWS, np.intp)

    def fn(x):
        x[...] = np.repeat(x, counts)[:ROWS]

    x = np.zeros(ROWS, np.float32)
    graph, a, hosts, outs = capture(fn, [x])
    launch(graph, a, hosts, outs, [x])
    counts[0] = 2
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


def test_a_read_only_argument_refuses_a_write_while_captured():
    dev = rf.device("sim")
    a, d, e = dev.create_stream(), dev.allocate(4 * ROWS), dev.allocate(4 * ROWS)
    x, y = d.array(np.float32, ROWS), e.array(np.float32, ROWS)
    a.begin_capture()
    with pytest.raises(ValueError, match="read-only"):
        a.launch(lambda x, y: x.__iadd__(1), x, y, reads=[x], writes=[y])
    a.abort_capture()
