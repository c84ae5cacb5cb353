"""Items of several arrays (tuples, lists, dicts: pytrees) through a ``Pipeline``: packed into one
slot, rebuilt for the compute on the device and for the caller on the host."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringflow as rf
from ringflow._pipeline import trees


def doubled(x, y):
    """Every leaf of ``y`` is twice the same leaf of ``x`` (same structure)."""
    xs, _ = trees.flatten(x)
    ys, _ = trees.flatten(y)
    for a, b in zip(xs, ys):
        b[...] = a * 2


DTYPES = ["uint8", "int16", "float16", "float32", "float64", "int64"]
leaf = st.tuples(st.lists(st.integers(0, 7), min_size=0, max_size=3), st.sampled_from(DTYPES))
structure = st.recursive(leaf, lambda kids: st.one_of(
    st.lists(kids, min_size=1, max_size=3), st.lists(kids, min_size=1, max_size=3).map(tuple),
    st.dictionaries(st.sampled_from(["images", "labels", "mask", "meta"]), kids, min_size=1, max_size=3)),
    max_leaves=6)


def build(spec, rng):
    if isinstance(spec, dict):
        return {k: build(v, rng) for k, v in spec.items()}
    if isinstance(spec, list):
        return [build(v, rng) for v in spec]
    if isinstance(spec, tuple) and not (len(spec) == 2 and isinstance(spec[1], str)):
        return tuple(build(v, rng) for v in spec)
    shape, dtype = spec
    return rng.integers(0, 50, shape).astype(dtype)


def same_tree(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype and np.array_equal(b, a * 2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(structure.filter(lambda s: not (isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], str))),
                      min_size=1, max_size=6),
       seed=st.integers(0, 2 ** 16), path=st.sampled_from(["staged", "workers", "rings"]))
def test_random_pytrees_come_back_in_their_structure(specs, seed, path):
    dev = rf.device("sim", chaos=True, seed=seed, checked=True)
    if path == "rings":
        rf.host.set_budget(1, device=dev)
    rng = np.random.default_rng(seed)
    items = [build(s, rng) for s in specs]
    with rf.Pipeline(doubled, device=dev, chunk_bytes=1 << 16, checked=True,
                     prepare=(lambda it: it) if path == "workers" else None) as pipe:
        out = list(pipe.map(items))
    for it, r in zip(items, out, strict=True):
        assert same_tree(it, r), (it, r)


def test_a_pytree_over_4_mib_may_be_changed_once_submit_returns():
    """An item of several arrays that fits a chunk is packed into pinned memory by the accepting
    thread, as a plain array is: the caller may overwrite its leaves as soon as ``submit``
    returns."""
    rng = np.random.default_rng(7)
    item = {"images": rng.integers(0, 50, (5 << 20) // 4).astype(np.float32), "labels": np.arange(10)}
    kept = {k: v.copy() for k, v in item.items()}
    with rf.Pipeline(doubled, device=rf.device("sim", seed=7), chunk_bytes=8 << 20, checked=True) as pipe:
        fut = pipe.submit(item)
        for leaf in item.values():
            leaf[...] = -1
        assert same_tree(kept, fut.result())


def test_images_and_labels_in_scores_and_labels_out():
    dev = rf.device("sim", chaos=True, seed=3)

    def classify(x, y):
        y["scores"][...] = x["images"].reshape(4, -1).mean(axis=1).astype(y["scores"].dtype)
        y["labels"][...] = x["labels"] + 1

    rng = np.random.default_rng(0)
    batches = [{"images": rng.integers(0, 255, (4, 3, 8, 8), dtype=np.uint8),
                "labels": rng.integers(0, 10, 4).astype(np.int64)} for _ in range(10)]
    spec = {"scores": ((4,), "float16"), "labels": ((4,), "int64")}
    with rf.Pipeline(classify, device=dev, chunk_bytes=4096, output=spec) as pipe:
        out = list(pipe.map(batches))
    for b, r in zip(batches, out, strict=True):
        assert list(r) == ["scores", "labels"]
        np.testing.assert_array_equal(r["scores"], b["images"].reshape(4, -1).mean(axis=1).astype(np.float16))
        np.testing.assert_array_equal(r["labels"], b["labels"] + 1)


def test_a_pytree_delivered_on_the_device():
    dev = rf.device("sim", seed=4)
    user = dev.create_stream()
    item = (np.arange(6, dtype=np.float32), {"k": np.ones((2, 2), np.int16)})
    with rf.Pipeline(doubled, device=dev, chunk_bytes=4096, deliver="device") as pipe:
        res = pipe.submit(item).result()
        assert res.shape is None and res.dtype is None
        a, d = res.array
        got = [np.empty(6, np.float32), np.empty((2, 2), np.int16)]

        def read(x, y):
            got[0][...] = x
            got[1][...] = y

        user.launch(read, a, d["k"], reads=[a, d["k"]])
        res.release(stream=user)
        user.sync()
    np.testing.assert_array_equal(got[0], item[0] * 2)
    np.testing.assert_array_equal(got[1], item[1]["k"] * 2)
    user.close()


def test_a_consumer_gets_the_structure_read_only():
    seen = []

    def consume(index, item, result):
        seen.append((type(result), [v.flags.writeable for v in result]))
        return None

    with rf.Pipeline(doubled, device=rf.device("sim"), chunk_bytes=4096, consume=consume) as pipe:
        list(pipe.map([[np.ones(3), np.zeros(2, np.int8)]]))
    assert seen == [(list, [False, False])]


class _Rows(list):
    """A list subclass whose constructor is list's own."""


class _Pair(tuple):
    """A tuple subclass that is not a named tuple."""


_Named = collections.namedtuple("_Named", "images labels")


@pytest.mark.parametrize("path", ["staged", "workers"])
def test_containers_subclassing_tuple_list_or_dict_come_back_as_their_base_or_named_tuple(path):
    """A subclass's constructor is not called with the leaves (list's and tuple's take one
    iterable, a named tuple one argument a field): such an item was refused by submit with
    "list expected at most 1 argument, got 2", naming nothing of ringflow's."""
    item = {"rows": _Rows([np.arange(3.0), np.arange(2, dtype=np.int8)]),
            "pair": _Pair((np.ones(2, np.float32), np.arange(4))),
            "named": _Named(np.arange(5, dtype=np.int16), np.ones(1)),
            "ordered": collections.OrderedDict(a=np.arange(2.0))}
    spec = _Pair((((3,), "float32"), _Rows([((2,), "int64")])))

    def first_leaves(x, y):
        y[0][...] = x["rows"][0].astype(np.float32)
        y[1][0][...] = x["pair"][1][:2]

    dev = rf.device("sim", checked=True)
    with rf.Pipeline(doubled, device=dev, chunk_bytes=1 << 14, checked=True,
                     prepare=(lambda it: it) if path == "workers" else None) as pipe:
        got = pipe.submit(item).result()
    assert type(got["rows"]) is list and type(got["pair"]) is tuple and type(got["named"]) is _Named
    assert type(got["ordered"]) is dict
    expected = {"rows": [a * 2 for a in item["rows"]], "pair": tuple(a * 2 for a in item["pair"]),
                "named": _Named(*(a * 2 for a in item["named"])), "ordered": {"a": item["ordered"]["a"] * 2}}
    for a, b in zip(trees.flatten(got)[0], trees.flatten(expected)[0], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    with rf.Pipeline(first_leaves, device=dev, chunk_bytes=1 << 14, checked=True, output=spec) as pipe:
        scores, (labels,) = pipe.submit(item).result()
    assert np.array_equal(scores, np.arange(3.0, dtype=np.float32)) and np.array_equal(labels, np.arange(2))
    assert dev.live().total == 0


def _holding_itself() -> dict:
    item = {"a": np.ones(3), "b": [np.ones(2)]}
    item["b"].append(item)
    return item


def _nested(depth: int) -> list:
    item: list = [np.ones(2)]
    for _ in range(depth):
        item = [item]
    return item


@pytest.mark.parametrize("make, error, match", [
    (_holding_itself, ValueError, "holds itself"),
    (lambda: _nested(trees.MAX_DEPTH + 5), ValueError, f"nested more than {trees.MAX_DEPTH}"),
    (lambda: _nested(5000), ValueError, "nested more than"),  # was a RecursionError
], ids=["holds itself", "too deep", "far too deep"])
def test_pytrees_holding_themselves_or_too_deep_are_refused_by_name(make, error, match):
    with rf.Pipeline(doubled, device=rf.device("sim"), chunk_bytes=4096) as pipe:
        with pytest.raises(error, match=match):
            pipe.submit(make())
        assert pipe.stats().accepted == 0
        shared = [np.ones(2), np.ones(2)]  # the same array twice is not a cycle
        got = pipe.submit((shared, shared)).result()
        assert len(got) == 2 and len(got[0]) == 2


def test_a_pytree_as_deep_as_allowed_goes_through():
    with rf.Pipeline(doubled, device=rf.device("sim"), chunk_bytes=4096) as pipe:
        got = pipe.submit(_nested(trees.MAX_DEPTH - 1)).result()
    for _ in range(trees.MAX_DEPTH - 1):
        got = got[0]
    assert np.array_equal(got[0], np.ones(2) * 2)


@pytest.mark.parametrize("item, error, match", [
    ((np.ones(3), "text"), TypeError, r"items \(each array of a tuple, list or dict\) must be numpy arrays"),
    ({"a": np.ones(3), "b": np.array([object()])}, TypeError, "holds Python objects"),
    ((np.ones(500), np.ones(500)), ValueError, r"takes 8096 bytes packed \(each aligned to 256 bytes\), more than a slot of 4096"),
])
def test_bad_pytrees_are_refused_before_acceptance(item, error, match):
    with rf.Pipeline(doubled, device=rf.device("sim"), chunk_bytes=4096) as pipe:
        with pytest.raises(error, match=match):
            pipe.submit(item)
        assert pipe.stats().accepted == 0


def test_flatten_and_packing():
    obj = {"a": (np.ones(3, np.uint8), [np.ones(2, np.float64)]), "b": np.ones((2, 2), np.int16)}
    leaves, tree = trees.flatten(obj)
    assert len(leaves) == 3
    rebuilt = trees.unflatten(tree, leaves)
    assert list(rebuilt) == ["a", "b"] and isinstance(rebuilt["a"], tuple) and isinstance(rebuilt["a"][1], list)
    layout = trees.packed(tree, [(a.shape, a.dtype) for a in leaves])
    assert [off for off, _, _ in layout.leaves] == [0, 256, 512] and layout.nbytes == 512 + 8
    with pytest.raises(ValueError, match="more leaves"):
        trees.unflatten(tree, leaves + [1])
    assert trees.is_spec(((4,), "f4")) and trees.is_spec((4, np.float32)) and not trees.is_spec((((4,), "f4"),) * 2)
