"""Items already in device memory: copied device to device in the h2d stage, never staged on the
host. On the simulated GPU a device array is a launch argument of one of its buffers."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from tests.helpers.sim import read_on


def f(x, y):
    y[...] = x * 2 + 1


def device_item(dev, stream, values: np.ndarray):
    """A device array holding ``values``, written by a kernel on ``stream``; its buffer too."""
    buf = dev.allocate(max(values.nbytes, 1))
    arg = buf.array(values.dtype, values.shape)

    def write(a):
        a[...] = values

    stream.launch(write, arg, writes=[arg])
    return buf, arg


@pytest.mark.parametrize("seed", range(3))
def test_device_items_come_back_exact_under_chaos(seed):
    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    user = dev.create_stream()
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(int(rng.integers(1, 300))).astype(np.float32) for _ in range(30)]
    made = [device_item(dev, user, v) for v in values]
    user.sync()  # the producer's work is done before the items are submitted
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, checked=True) as pipe:
        mixed = [arg if i % 2 else values[i] for i, (_, arg) in enumerate(made)]  # device and host items
        out = list(pipe.map(mixed))
    for v, r in zip(values, out, strict=True):
        np.testing.assert_array_equal(r, v * 2 + 1)
    for buf, _ in made:
        buf.close()
    user.close()
    assert dev.live().total == 0


def test_a_device_item_whose_producer_is_not_done_is_caught():
    """Submitted while the kernel writing it may still run (no sync, no stream to wait on): the
    checker sees the copy's read and that write unordered."""
    outcomes = []
    for seed in range(4):
        dev = rf.device("sim", chaos=True, seed=seed, checked=True)
        user = dev.create_stream()
        buf, arg = device_item(dev, user, np.ones(64, np.float32))
        try:
            with rf.Pipeline(f, device=dev, chunk_bytes=4096) as pipe:
                pipe.submit(arg).result()
            outcomes.append(True)
        except BaseException as exc:  # noqa: BLE001 - however the checker's error surfaced
            outcomes.append(exc)
    assert any(isinstance(o, rf.HazardError) or isinstance(getattr(o, "__cause__", None), rf.HazardError)
               or "HazardError" in repr(o) for o in outcomes), outcomes


def test_device_items_with_an_output_spec_and_delivered_on_the_device():
    dev = rf.device("sim", seed=5)
    user = dev.create_stream()
    buf, arg = device_item(dev, user, np.arange(8, dtype=np.float32))
    user.sync()

    def halves(x, y):
        y[...] = x.reshape(2, 4).sum(axis=1)

    with rf.Pipeline(halves, device=dev, chunk_bytes=4096, output=((2,), "float32")) as pipe:
        np.testing.assert_array_equal(pipe.submit(arg).result(), [6.0, 22.0])
    with rf.Pipeline(f, device=dev, chunk_bytes=4096, deliver="device") as pipe:
        res = pipe.submit(arg).result()
        got = read_on(user, res)
        res.release(stream=user)
        user.sync()
    np.testing.assert_array_equal(got, np.arange(8, dtype=np.float32) * 2 + 1)
    buf.close()
    user.close()


def test_a_device_item_too_big_for_a_slot_is_refused():
    dev = rf.device("sim")
    buf = dev.allocate(8192)
    with rf.Pipeline(f, device=dev, chunk_bytes=4096) as pipe:
        with pytest.raises(ValueError, match="does not fit a slot of 4096 bytes"):
            pipe.submit(buf.array(np.float32, 2048))
    buf.close()
