"""One handle on what a process owns (a pipeline, a chunk's future, a lent device slot, a job) refuses to
be copied or pickled: a copy would be a second handle on the one thing (closed, settled or
released by either), and a pickle cannot carry threads, streams or device memory to another
process."""

from __future__ import annotations

from typing import Any


class Uncopyable:
    """Mixin: ``copy.copy``, ``copy.deepcopy`` and pickling raise TypeError, with the message
    :meth:`_not_copied` gives (what the object is, and what to share or copy instead)."""

    __slots__ = ()

    def _not_copied(self, what: str) -> str:
        """Why this object cannot be ``what`` ("pickled" or "copied"), and what to do instead."""
        raise NotImplementedError

    def __reduce__(self) -> Any:
        """Raises TypeError (see :meth:`_not_copied`)."""
        raise TypeError(self._not_copied("pickled"))

    def __copy__(self) -> Any:
        """Raises TypeError (see :meth:`_not_copied`)."""
        raise TypeError(self._not_copied("copied"))

    def __deepcopy__(self, memo: dict) -> Any:
        """Raises TypeError (see :meth:`_not_copied`)."""
        raise TypeError(self._not_copied("copied"))
