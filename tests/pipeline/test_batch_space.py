"""The pinned space of shared chunks: parts handed out front to back, the last one shrinking to
what its chunk used once the next is reserved, never while it may still take items."""

from __future__ import annotations

import types

import numpy as np
from hypothesis import given, settings, strategies as st

from ringflow._pipeline.batch_space import SLAB_CHUNKS, BatchSpace, aligned


def _space(chunk_bytes: int = 1024) -> tuple[BatchSpace, np.ndarray]:
    space = BatchSpace(chunk_bytes)
    slab = np.zeros(space.slab_bytes, np.uint8)
    assert space.install(slab, 1)
    return space, slab


def _start(part: np.ndarray, slab: np.ndarray) -> int:
    return part.__array_interface__["data"][0] - slab.__array_interface__["data"][0]


def test_a_part_shrinks_to_what_its_chunk_used_when_the_next_is_reserved():
    space, slab = _space()
    first = space.reserve(100)
    assert first.nbytes == 1024 and _start(first, slab) == 0
    space.claimed(types.SimpleNamespace(used=300))
    second = space.reserve(100)
    assert _start(second, slab) == aligned(300) == 512
    space.claimed(types.SimpleNamespace(used=0))  # (all its items taken back: nothing kept)
    assert _start(space.reserve(1), slab) == 512


def test_a_part_never_claimed_goes_back_whole():
    space, slab = _space()
    space.reserve(10)  # an interrupt before the chunk was opened
    assert _start(space.reserve(10), slab) == 0


def test_the_last_part_of_a_slab_may_be_shorter_than_a_chunk_but_holds_the_item():
    space, slab = _space()
    for _ in range(SLAB_CHUNKS - 1):
        space.reserve(1)
        space.claimed(types.SimpleNamespace(used=1024))
    space.reserve(1)
    space.claimed(types.SimpleNamespace(used=1000))
    tail = space.reserve(24)  # 1024 - aligned(1000) = 0 bytes left: none
    assert tail is None


def test_installing_a_slab_leaves_an_open_part_whole():
    """A thread that found no room gives the space a new slab; meanwhile another opened a chunk
    in the old one, which may still take items: its room stays counted (shrinking it then made
    the old slab look roomy, and the next chunk's part overlapped the open one's later items)."""
    space, slab = _space()
    for _ in range(SLAB_CHUNKS - 1):
        space.reserve(1)
        space.claimed(types.SimpleNamespace(used=1024))
    open_part = space.reserve(1)
    chunk = types.SimpleNamespace(used=8)
    space.claimed(chunk)
    new = np.zeros(space.slab_bytes, np.uint8)
    assert space.install(new, 512)
    chunk.used = 1024  # the open chunk took more items meanwhile
    assert _start(space.reserve(1), new) == 0
    assert open_part.nbytes == 1024


def test_a_slab_with_room_stays():
    space, slab = _space()
    space.reserve(1)
    space.claimed(types.SimpleNamespace(used=10))
    assert not space.install(np.zeros(space.slab_bytes, np.uint8), 512)  # another thread's slab came first
    assert _start(space.reserve(1), slab) == 256


def test_a_new_slab_replaces_a_full_one():
    space, slab = _space()
    for _ in range(SLAB_CHUNKS):
        space.reserve(1)
        space.claimed(types.SimpleNamespace(used=1024))
    new = np.zeros(space.slab_bytes, np.uint8)
    assert space.reserve(1) is None
    assert space.install(new, 1)
    assert _start(space.reserve(1), new) == 0
    space.release()
    assert space.reserve(1) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["open", "grow", "install"]), st.integers(1, 1024)), max_size=60))
def test_no_two_chunks_ever_share_a_byte(ops):
    """Any sequence of chunks opened (each closing the one before), the open chunk taking more
    items, and new slabs given: the bytes each chunk may still write (its whole part while it
    is open, what it used once closed) never overlap another chunk's."""
    space = BatchSpace(1024)
    chunks = []  # [slab id, start, part bytes, chunk, part]; the last one opened may still grow

    def install(need: int) -> None:
        space.install(np.zeros(space.slab_bytes, np.uint8), need)

    install(1)
    for op, n in ops:
        if op == "install":
            install(n)
        elif op == "grow" and chunks:
            entry = chunks[-1]
            entry[3].used = min(entry[2], entry[3].used + n)  # it takes items only within its part
        elif op == "open":
            part = space.reserve(n)
            if part is None:  # as a submitting thread does: a new slab, then again
                install(n)
                part = space.reserve(n)
            assert part is not None and part.nbytes >= n
            chunk = types.SimpleNamespace(used=n)
            space.claimed(chunk)
            base = part.base
            chunks.append([id(base), _start(part, base), part.nbytes, chunk, part])  # the part keeps its slab
        spans = sorted((slab, start, start + (size if i == len(chunks) - 1 else c.used))
                       for i, (slab, start, size, c, _) in enumerate(chunks))
        assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:])), spans
