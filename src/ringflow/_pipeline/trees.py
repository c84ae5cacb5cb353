"""Items that are several arrays: tuples, lists and dicts of arrays (pytrees), packed into one slot.

A pytree item travels as one run of bytes: each leaf at its own offset in the slot, aligned to
:data:`ALIGN` bytes, so the copy engines move one region per chunk whatever the structure. The
scheduler sees a packed chunk as ``uint8`` bytes; only the compute (which gets the structure back
as device arrays) and the result (the structure back as host arrays over the result's bytes)
know the :class:`Packed` layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from .._device.protocol import BufferSlice

ALIGN = 256  # bytes: every leaf starts on a boundary a device array of any dtype accepts

LEAF = None  # the tree of a single leaf
MAX_DEPTH = 100  # containers deep: an item deeper than this is refused by name, not by a RecursionError


def is_tree(obj: Any) -> bool:
    """Whether ``obj`` is a structure of leaves rather than one leaf."""
    return isinstance(obj, (tuple, list, dict))


def flatten(obj: Any, is_leaf: Callable[[Any], bool] = lambda o: not is_tree(o)) -> tuple[list, Any]:
    """``(leaves, tree)`` of a nested tuple/list/dict (dict keys in insertion order); a leaf is
    anything ``is_leaf`` says is one. A named tuple is rebuilt as its own type by
    :func:`unflatten`; any other subclass of tuple, list or dict as that base type.

    Raises:
        ValueError: the structure holds itself, or is nested deeper than :data:`MAX_DEPTH`.
    """
    path: set[int] = set()  # the containers from the top down to the one being walked

    def walk(node: Any) -> tuple[list, Any]:
        if is_leaf(node):
            return [node], LEAF
        if id(node) in path:
            raise ValueError("an item holds itself (a tuple, list or dict inside itself); items are trees of arrays")
        if len(path) >= MAX_DEPTH:
            raise ValueError(f"an item is nested more than {MAX_DEPTH} tuples, lists or dicts deep; flatten it")
        if not isinstance(node, (dict, tuple, list)):
            raise TypeError(f"not a leaf and not a tuple, list or dict: {type(node).__name__}")
        path.add(id(node))
        try:
            children = node.values() if isinstance(node, dict) else node
            leaves: list = []
            trees = []
            for child in children:
                sub, tree = walk(child)
                leaves += sub
                trees.append(tree)
        finally:
            path.discard(id(node))
        if isinstance(node, dict):
            return leaves, (dict, tuple(node), tuple(trees))
        return leaves, (_container_kind(node), None, tuple(trees))

    return walk(obj)


def _container_kind(node: "tuple | list") -> type:
    """The type :func:`_build` rebuilds ``node`` as: ``list``, ``tuple`` or a named tuple's type.
    Another subclass's constructor takes what its own code says (not the items as list() and
    tuple() take them, nor one argument an item as a named tuple does), so it is rebuilt as its
    base type, as a dict subclass is rebuilt as a dict."""
    kind = type(node)
    if kind is list or kind is tuple or (isinstance(node, tuple) and hasattr(kind, "_fields")):
        return kind
    return list if isinstance(node, list) else tuple


def unflatten(tree: Any, leaves: Sequence[Any]) -> Any:
    """The structure ``tree`` (from :func:`flatten`) with ``leaves`` in order."""
    it = iter(leaves)
    out = _build(tree, it)
    if next(it, _END) is not _END:
        raise ValueError("more leaves than the tree holds")
    return out


_END = object()


def _build(tree: Any, it) -> Any:
    if tree is LEAF:
        return next(it)
    kind, keys, children = tree
    built = [_build(child, it) for child in children]
    if kind is dict:
        return dict(zip(keys, built))
    return kind(built) if kind is list else tuple(built) if kind is tuple else kind(*built)


@dataclasses.dataclass(frozen=True)
class Packed:
    """Where each leaf of a structure lies in one run of bytes.

    Attributes:
        tree: the structure (:func:`flatten`'s).
        leaves: ``(offset, shape, dtype)`` of each leaf, in order.
        nbytes: the bytes the run needs (the last leaf's end).
    """

    tree: Any
    leaves: tuple
    nbytes: int


def packed(tree: Any, specs: Sequence[tuple]) -> Packed:
    """The layout of leaves ``specs`` (``(shape, dtype)`` each) under ``tree``, each aligned to
    :data:`ALIGN`."""
    out, offset = [], 0
    for shape, dtype in specs:
        dtype = np.dtype(dtype)
        offset = -(-offset // ALIGN) * ALIGN
        out.append((offset, tuple(shape), dtype))
        offset += math.prod(shape) * dtype.itemsize
    return Packed(tree, tuple(out), offset)


def pack_into(layout: Packed, leaves: Sequence[np.ndarray], raw: np.ndarray) -> None:
    """Copy ``leaves`` into ``raw`` (writable ``uint8``, at least ``layout.nbytes``) at their offsets."""
    for (offset, shape, dtype), leaf in zip(layout.leaves, leaves):
        n = math.prod(shape) * dtype.itemsize
        np.copyto(raw[offset:offset + n].view(dtype).reshape(shape), leaf, casting="no")


def host_views(layout: Packed, raw: np.ndarray) -> Any:
    """The structure of typed views of ``raw`` (``uint8``), one per leaf."""
    views = []
    for offset, shape, dtype in layout.leaves:
        n = math.prod(shape) * dtype.itemsize
        views.append(raw[offset:offset + n].view(dtype).reshape(shape))
    return unflatten(layout.tree, views)


def device_args(layout: Packed, where: BufferSlice) -> list:
    """The launch arguments of each leaf in the slot ``where``, in order."""
    return [where.buffer.array(dtype, shape, where.offset + offset) for offset, shape, dtype in layout.leaves]


def is_spec(obj: Any) -> bool:
    """Whether ``obj`` is one ``(shape, dtype)`` pair (not a structure of them). Its dtype may be
    one numpy spells as a list, tuple or dict (fields ``[("a", "f4"), ...]``, a subarray
    ``("f4", (2,))``, names and formats)."""
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        return False
    shape, dtype = obj
    if isinstance(dtype, (str, type, np.dtype)):  # meant as a pair (a bad shape is then reported as one)
        return True
    shape_like = isinstance(shape, (int, np.integer)) or (
        isinstance(shape, (tuple, list)) and all(isinstance(d, (int, np.integer)) for d in shape))
    if not shape_like:
        return False
    if not isinstance(dtype, (tuple, list, dict)):
        return True
    # a structure of pairs never starts with a shape, but for the empty one, ``()``: that pair
    # is a pair whose dtype is a container numpy reads as a dtype, and no pair itself
    if is_spec(dtype):
        return False
    try:
        np.dtype(dtype)
    except Exception:  # noqa: BLE001 - numpy raises TypeError, ValueError or KeyError for what is no dtype
        return False
    return True
