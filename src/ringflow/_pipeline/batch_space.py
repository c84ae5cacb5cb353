"""Pinned space for chunks that items share, packed one after another in slabs.

Why: an item sharing a chunk is copied into the chunk's pinned block on the submitting thread,
and its result must come back into pinned memory too. Taking a pool array for every result, and
a block for every chunk, cost the submitting thread a pool hand-out per item, and the copy
back one d2h per item. Instead, a chunk's part of a slab holds its items going in and their
results coming back (one d2h writes the whole part over the inputs the h2d has read), and each
result is a view of its own bytes there. A slab goes back to the pool once every chunk and
result in it is gone.

A chunk gets room for a whole chunk while it takes items; once it stops (the next chunk is
opened after it), its part shrinks to what its items used, so chunks that end up holding one
small item each (an idle stream) lie packed, and a result pins its own bytes and its
neighbours', not a chunk's worth. See docs/design.md, "Items sharing a chunk".

Not thread-safe: the scheduler's batch lock guards every call.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._plan import aligned

SLAB_CHUNKS = 4  # a slab holds this many full chunks


class BatchSpace:
    """Slabs (uint8 pinned pool arrays of :attr:`slab_bytes`) handed out front to back as the
    blocks of shared chunks.

    Args:
        chunk_bytes: the most a chunk may hold (bytes).
    """

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.slab_bytes = SLAB_CHUNKS * chunk_bytes
        self._slab: Optional[np.ndarray] = None
        self._top = 0  # the slab's bytes below this are handed out
        self._last_start: Optional[int] = None  # where the part handed out last starts
        self._last_chunk: Any = None  # the chunk that part is (None until claimed)

    def reserve(self, need: int) -> Optional[np.ndarray]:
        """A part of the current slab for a new chunk: up to a chunk's bytes, at least ``need``;
        None when the slab has less room (give it a new one with :meth:`install`). The part
        handed out before shrinks first to what its chunk used: the caller must have closed that
        chunk (it takes no more items), whether or not this finds room."""
        self._trim_last()
        slab = self._slab
        if slab is None or slab.nbytes - self._top < need:
            return None
        start = self._top
        part = slab[start:start + min(self.chunk_bytes, slab.nbytes - start)]
        self._last_start, self._last_chunk = start, None
        self._top = start + part.nbytes
        return part

    def claimed(self, chunk: Any) -> None:
        """The part :meth:`reserve` returned last is ``chunk``'s block (``chunk.batch``, with its
        items' bytes below ``chunk.used``)."""
        self._last_chunk = chunk

    def install(self, slab: np.ndarray, need: int) -> bool:
        """Make ``slab`` (a uint8 pool array of :attr:`slab_bytes`) the current slab, unless the
        current one still has ``need`` bytes of room (another thread gave it a new one): returns
        whether it did. The slab given up stays alive while its chunks or results are. The
        part handed out last may still be taking items: its room counts as used here."""
        if self._slab is not None and self._slab.nbytes - self._top >= need:
            return False
        self._slab, self._top = slab, 0
        self._last_start = self._last_chunk = None
        return True

    def release(self) -> None:
        """Give up the current slab (the pipeline is closing)."""
        self._slab, self._top = None, 0
        self._last_start = self._last_chunk = None

    def _trim_last(self) -> None:
        start = self._last_start
        if start is None:
            return
        chunk = self._last_chunk
        # a part never claimed (an interrupt between reserving and opening) holds nothing: all
        # of it goes back. A chunk's used bytes never shrink (an item taken back leaves its gap)
        used = chunk.used if chunk is not None else 0
        self._top = min(self._top, start + aligned(used))
        self._last_start = self._last_chunk = None
