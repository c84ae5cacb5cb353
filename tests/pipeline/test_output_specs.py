"""``Pipeline(output=...)``: results of another shape and dtype than the input.

The compute below writes ``2 * x`` (as the output dtype) into the first elements of ``y`` and 7
into the rest, so every result is known exactly whatever the spec: smaller, larger, another
dtype, per item or fixed, staged by ``submit`` or by the workers, pooled or not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow._pipeline import trees
from tests.helpers.dtypes import refusal


def spread(x, y):
    flat, out = x.reshape(-1), y.reshape(-1)
    n = min(flat.size, out.size)
    out[:n] = (flat[:n] * 2).astype(out.dtype)
    out[n:] = 7


def expected(item: np.ndarray, shape, dtype) -> np.ndarray:
    out = np.full(int(np.prod(shape)), 7, dtype)
    flat = item.reshape(-1)
    n = min(flat.size, out.size)
    out[:n] = (flat[:n] * 2).astype(dtype)
    return out.reshape(shape)


DTYPES = ["uint8", "int16", "float16", "float32", "float64", "int64"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(st.tuples(st.integers(0, 300), st.lists(st.integers(0, 40), min_size=1, max_size=3),
                                st.sampled_from(DTYPES)), min_size=1, max_size=12),
       seed=st.integers(0, 2 ** 16), budget=st.sampled_from([None, 1]), staged_by=st.sampled_from(["submit", "workers"]))
def test_random_output_specs_come_back_exact(specs, seed, budget, staged_by):
    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    if budget is not None:
        rf.host.set_budget(budget, device=dev)  # no pool: every result through the host-out ring
    rng = np.random.default_rng(seed)
    items = [rng.integers(0, 100, n).astype(np.float32) for n, _, _ in specs]
    shapes = {id(it): (tuple(shape), np.dtype(dt)) for it, (_, shape, dt) in zip(items, specs)}
    prepare = np.asarray if staged_by == "workers" else None
    with rf.Pipeline(spread, device=dev, chunk_bytes=1 << 19, output=lambda it: shapes[id(it)], prepare=prepare,
                     checked=True) as pipe:
        results = list(pipe.map(items))
    for it, r in zip(items, results, strict=True):
        shape, dtype = shapes[id(it)]
        assert r.shape == shape and r.dtype == dtype
        np.testing.assert_array_equal(r, expected(it, shape, dtype))


def test_a_fixed_spec_for_every_item_uint8_in_float16_out():
    """The inference shape: uint8 images in, a float16 row of scores out."""
    dev = rf.device("sim", chaos=True, seed=2)
    images = [np.random.default_rng(i).integers(0, 255, (3, 8, 8), dtype=np.uint8) for i in range(10)]

    def scores(x, y):
        y[...] = x.reshape(3, -1).mean(axis=1).astype(y.dtype)

    with rf.Pipeline(scores, device=dev, chunk_bytes=4096, output=((3,), "float16")) as pipe:
        futs = [pipe.submit(im) for im in images]
        out = [fu.result() for fu in futs]
    for im, r in zip(images, out):
        assert r.dtype == np.float16 and r.shape == (3,)
        np.testing.assert_array_equal(r, im.reshape(3, -1).mean(axis=1).astype(np.float16))
        assert rf.host.buffer(r) is not None  # taken from the pool by submit for the other shape


def test_a_consumer_sees_the_output_shape():
    seen = []
    with rf.Pipeline(spread, device=rf.device("sim"), chunk_bytes=4096, output=((2, 3), np.int16),
                     consume=lambda i, item, r: seen.append((r.shape, r.dtype, r.flags.writeable))) as pipe:
        list(pipe.map([np.ones(10, np.float32)] * 3))
    assert seen == [((2, 3), np.dtype(np.int16), False)] * 3


@pytest.mark.parametrize("output, error, match", [
    ((4,), TypeError, r"output must be a \(shape, dtype\) pair"),
    (((4,), "no-such-type"), TypeError, "not a numpy dtype"),
    (((4,), ","), TypeError, "not a numpy dtype"),  # numpy raises SyntaxError for this string
    (((4,), "i4,(2"), TypeError, "not a numpy dtype"),
    (((4,), object), TypeError, "holds Python objects"),
    (((-1, 4), "float32"), ValueError, "negative dimension"),
    ((("a",), "float32"), TypeError, "shape must be an int or a sequence of ints"),
    ((4.5, "float32"), TypeError, "shape must be an int"),
    # shapes numpy cannot make: refused here, not when the first result is built (in a tree, that
    # had killed the progress thread; alone, it failed each item in ringflow's own consumer)
    ((((1,) * 65, "float32"), ((2,), "float32")), ValueError, "output: shape .* has 65 dimensions"),
    (((1,) * 65, "float32"), ValueError, "output: shape .* has 65 dimensions"),
    (((0, 2 ** 62), "float32"), ValueError, "output: shape .* has more elements than numpy can index"),
    (((2 ** 32, 2 ** 32, 2 ** 32, 0), "uint8"), ValueError, "more elements than numpy can index"),
])
def test_bad_fixed_specs_are_refused_at_construction(output, error, match):
    with pytest.raises(error, match=match):
        rf.Pipeline(spread, device=rf.device("sim"), chunk_bytes=4096, output=output)


def test_bad_per_item_specs_are_refused_by_submit_and_map_and_the_pipeline_goes_on():
    dev = rf.device("sim")
    bad = {"pair": 5, "big": ((10_000,), "float64"), "raise": None}

    def output(item):
        kind = bad.get(str(item.dtype) if False else item.tobytes()[:0].decode() or None)
        return ((item.size,), item.dtype) if kind is None else kind

    def spec(item):
        n = int(item[0])
        if n == 1:
            return 5
        if n == 2:
            return ((10_000,), "float64")
        if n == 3:
            raise KeyError("no spec for this item")
        return ((item.size,), "float32")

    with rf.Pipeline(spread, device=dev, chunk_bytes=4096, output=spec) as pipe:
        with pytest.raises(TypeError, match=r"output\(item\) must be a \(shape, dtype\) pair"):
            pipe.submit(np.full(4, 1, np.float32))
        with pytest.raises(ValueError, match="does not fit a slot of 4096 bytes; raise chunk_bytes"):
            pipe.submit(np.full(4, 2, np.float32))
        with pytest.raises(KeyError):
            pipe.submit(np.full(4, 3, np.float32))
        assert np.array_equal(pipe.submit(np.full(4, 4, np.float32)).result(), np.full(4, 8, np.float32))
        with pytest.raises(TypeError, match="pair"):
            list(pipe.map([np.full(4, 4, np.float32), np.full(4, 1, np.float32)]))
    assert pipe.stats().in_flight == 0


def test_output_with_inplace_is_refused():
    with pytest.raises(ValueError, match="output= cannot be used with inplace=True"):
        rf.Pipeline(spread, device=rf.device("sim"), chunk_bytes=4096, inplace=True, output=((4,), "float32"))


def test_a_zero_byte_output_delivers_an_empty_result():
    with rf.Pipeline(spread, device=rf.device("sim"), chunk_bytes=4096, output=((0, 5), "int8")) as pipe:
        r = pipe.submit(np.ones(8, np.float32)).result()
    assert r.shape == (0, 5) and r.dtype == np.int8


def _zeroed(x, y):
    for leaf in trees.flatten(y)[0]:
        leaf[...] = np.zeros((), leaf.dtype)


FIELDS = [("a", "f4"), ("b", "i2")]


@pytest.mark.parametrize("output, dtype", [
    (((3,), FIELDS), np.dtype(FIELDS)),  # fields, as numpy spells them: a list of pairs
    (((3,), [("a", "f4")]), np.dtype([("a", "f4")])),
    ((3, FIELDS), np.dtype(FIELDS)),
    (((), FIELDS), np.dtype(FIELDS)),
    (((3,), {"names": ["a", "b"], "formats": ["u1", "f8"]}), np.dtype({"names": ["a", "b"], "formats": ["u1", "f8"]})),
    ([[3], FIELDS], np.dtype(FIELDS)),
], ids=["fields", "one field", "int shape", "0-d", "names and formats", "lists"])
def test_a_dtype_numpy_spells_as_a_container_is_one_spec(output, dtype):
    """A pair whose dtype is a list or dict numpy reads as a dtype is one (shape, dtype) spec, as
    stream_map takes it (it was taken for a tree of specs and refused, naming a dimension as the
    spec); alone and inside a tree of specs. A record is no dtype a GPU array holds, so the spec
    is refused naming the whole record dtype, with what to pass instead."""
    with pytest.raises(TypeError, match=r"^output: " + refusal(dtype, "each field as an array of its own")):
        rf.Pipeline(_zeroed, device=rf.device("sim"), chunk_bytes=4096, output=output)
    with pytest.raises(TypeError, match=r"^output: " + refusal(dtype, "each field as an array of its own")):
        rf.Pipeline(_zeroed, device=rf.device("sim"), chunk_bytes=4096, output={"k": output, "n": ((2,), "i8")})


@pytest.mark.parametrize("output", [((3,), ("f4", (2,))), {"k": ((3,), ("f4", (2,)))}], ids=["alone", "in a tree"])
def test_a_subarray_dtype_appends_its_shape(output):
    """A subarray dtype is one spec, its shape appended, as np.empty does."""
    with rf.Pipeline(_zeroed, device=rf.device("sim"), chunk_bytes=4096, output=output) as pipe:
        r = pipe.submit(np.ones(8, np.float32)).result(timeout=30)
    r = r["k"] if isinstance(output, dict) else r
    assert r.shape == (3, 2) and r.dtype == np.float32 and not r.tobytes().strip(b"\0")


def test_a_tree_of_specs_with_an_empty_tree_first_is_still_a_tree():
    with rf.Pipeline(_zeroed, device=rf.device("sim"), chunk_bytes=4096, output=((), ((2,), "f4"))) as pipe:
        r = pipe.submit(np.ones(8, np.float32)).result(timeout=30)
    assert r[0] == () and r[1].shape == (2,) and r[1].dtype == np.float32


@pytest.mark.parametrize("make", [
    lambda pipe: pipe.submit(np.ones(4, np.float32)),
    lambda pipe: pipe.submit(np.broadcast_to(np.float32(1), (1 << 39,))),  # 2 TiB, over no memory
    lambda pipe: pipe.submit((np.broadcast_to(np.float32(1), (1 << 39,)),)),
], ids=["output", "item", "item of several arrays"])
def test_what_no_slot_can_hold_is_not_told_to_raise_chunk_bytes_beyond_its_limit(make):
    """An item or output larger than any slot may be (chunk_bytes is at most 1 TiB) is told to be
    split, not to raise chunk_bytes to a size chunk_bytes refuses."""
    with rf.Pipeline(spread, device=rf.device("sim"), chunk_bytes=4096,
                     output=lambda item: ((1 << 39,), "float32") if item.size == 4 else (item.shape, item.dtype)) as pipe:
        with pytest.raises(ValueError, match=r"more than any slot holds \(chunk_bytes is at most 1099511627776 "
                                             r"bytes\); split") as caught:
            make(pipe)
        assert "raise chunk_bytes" not in str(caught.value)
        assert pipe.stats().accepted == 0



def _pinned_ring_bytes(pipe) -> dict:
    """The pinned bytes each host ring of ``pipe`` allocated, by ring kind."""
    return {r.kind.value: r.buffer.nbytes for r in pipe.scheduler.rings if r.buffer.is_host and not r.external}


@pytest.mark.parametrize("pooled", [True, False])
def test_a_fixed_output_smaller_than_a_chunk_gets_host_out_slots_of_its_bytes(pooled):
    """A reduction's results are a small part of its chunks: its host-out slots hold a result's
    bytes, not a chunk's, and every result is still exact where the checked mode poisons each slot
    freed (without the pool, every result goes through a host-out slot)."""
    dev = rf.device("sim", checked=True)
    if not pooled:
        rf.host.set_budget(1, device=dev)
    chunk, spec = 1 << 16, ((16,), np.dtype(np.float32))
    items = [np.random.default_rng(i).uniform(-2, 2, chunk // 4).astype(np.float32) for i in range(12)]
    with rf.Pipeline(spread, device=dev, chunk_bytes=chunk, output=spec, checked=True, slots=3) as pipe:
        assert _pinned_ring_bytes(pipe) == {"host-in": 3 * chunk, "host-out": 2 * 256 + 64}
        assert pipe.scheduler.host_out.chunk_bytes == 64
        got = list(pipe.map(items))
    assert all(np.array_equal(g, expected(i, *spec)) for g, i in zip(got, items, strict=True))


def test_pinned_budget_counts_host_out_slots_at_a_fixed_outputs_bytes():
    """Three host-in slots of a chunk and three host-out slots of a result fit a budget that three
    chunks each way would not."""
    chunk, spec = 1 << 16, ((16,), "float32")
    with rf.Pipeline(spread, device=rf.device("sim"), chunk_bytes=chunk, output=spec, slots=3,
                     pinned_budget=3 * chunk + 3 * 256) as pipe:
        assert pipe.config.slots.host_out == 3


def _device_ring_bytes(pipe) -> dict:
    """The device bytes each device ring of ``pipe`` allocated, by ring kind."""
    return {r.kind.value: r.buffer.nbytes for r in pipe.scheduler.rings if not r.buffer.is_host}


@pytest.mark.parametrize("packed", [False, True])
def test_a_fixed_output_smaller_than_a_chunk_gets_device_out_slots_of_its_bytes(packed):
    """A reduction's results are a small part of its chunks: its device-out slots hold a result's
    bytes, each on a 256-byte boundary, and its device-in slots a chunk's; every result is still
    exact where the checked mode poisons each slot freed (a slot too small, or a result written at
    another slot's bytes, would show here)."""
    dev = rf.device("sim", checked=True)
    chunk = 1 << 16
    spec = {"a": ((16,), np.dtype(np.float32)), "b": ((3,), np.dtype(np.int16))} if packed else \
        ((16,), np.dtype(np.float32))

    def reduce(x, y):
        leaves = [y["a"], y["b"]] if packed else [y]
        for k, leaf in enumerate(leaves):
            leaf[...] = (x.reshape(leaf.size, -1).sum(axis=1) + k).reshape(leaf.shape).astype(leaf.dtype)

    items = [np.random.default_rng(i).integers(-4, 4, chunk // 4 - 16 * i).astype(np.float32) for i in range(12)]
    items = [it[:it.size // 48 * 48] for it in items]  # whole rows for either leaf
    with rf.Pipeline(reduce, device=dev, chunk_bytes=chunk, output=spec, checked=True, slots=3) as pipe:
        out_bytes, stride = (256 + 6, 512) if packed else (64, 256)  # (a packed leaf starts 256 bytes after the last)
        assert pipe.config.out_bytes == out_bytes
        assert _device_ring_bytes(pipe) == {"device-in": 3 * chunk, "device-out": 2 * stride + out_bytes}
        assert dev.memory_in_use == 3 * chunk + 2 * stride + out_bytes
        got = list(pipe.map(items))
    for g, it in zip(got, items, strict=True):
        want = {}
        for k, (name, (shape, dtype)) in enumerate(sorted(spec.items()) if packed else [("", spec)]):
            want[name] = (it.reshape(int(np.prod(shape)), -1).sum(axis=1) + k).reshape(shape).astype(dtype)
        if packed:
            assert set(g) == {"a", "b"}
            for name in want:
                np.testing.assert_array_equal(g[name], want[name])
        else:
            np.testing.assert_array_equal(g, want[""])
