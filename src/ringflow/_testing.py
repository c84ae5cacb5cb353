"""The one seam through which tests and benchmarks reach inside ringflow's engines.

Public constructors take no private parameters. A test that must switch a guard off, watch
every slot transition or get hold of the engine a whole-array call used does so here::

    from ringflow import _testing

    with _testing.inject(guards_off={"d2h.wait_compute"}):
        rf.stream_map(f, x, device=dev)          # runs without that wait

Every engine (the scheduler's pipeline and the direct engine) reads :func:`current` once, when
it is built, so hooks apply to engines built inside the ``with`` block and to nothing else. The
hooks live in a :class:`contextvars.ContextVar`: another thread (or task) sees none unless it
enters its own ``inject``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterable, Iterator, Optional


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What tests inject.

    Attributes:
        guards_off: names of guards (waits and release rules, see each engine's ``GUARDS``) to
            switch off; an engine refuses names it does not know.
        slot_hook: called as ``slot_hook(ring_kind, slot_index, old_state, new_state)`` on every
            slot transition of a scheduler's rings.
        on_engine: called with the engine (a ``Pipeline`` for the scheduler's engine, a
            ``DirectSchedule`` for the direct one) that a whole-array call is about to run.
    """

    guards_off: frozenset = frozenset()
    slot_hook: Optional[Callable[..., Any]] = None
    on_engine: Optional[Callable[[Any], Any]] = None


NONE = Hooks()
_CURRENT: contextvars.ContextVar[Hooks] = contextvars.ContextVar("ringflow_test_hooks", default=NONE)


def current() -> Hooks:
    """The hooks in force in this context (no hooks outside :func:`inject`)."""
    return _CURRENT.get()


@contextlib.contextmanager
def inject(*, guards_off: Iterable[str] = (), slot_hook: Optional[Callable[..., Any]] = None,
           on_engine: Optional[Callable[[Any], Any]] = None) -> Iterator[Hooks]:
    """Apply hooks to every engine built inside the block; yields the :class:`Hooks`.

    Args:
        guards_off: guard names to switch off (tests only: the guard's absence must be caught).
        slot_hook: see :class:`Hooks`.
        on_engine: see :class:`Hooks`.
    """
    hooks = Hooks(frozenset(guards_off), slot_hook, on_engine)
    token = _CURRENT.set(hooks)
    try:
        yield hooks
    finally:
        _CURRENT.reset(token)
