"""Reading every thread's frame with the collector off (the CPython 3.11 deadlock)."""

from __future__ import annotations

import gc
import sys
import threading

from ringflow._bench import stacks


def test_the_collector_is_off_while_the_frames_are_read_and_as_it_was_after(monkeypatch):
    """sys._current_frames() can start a collection while it holds the thread-state lock, and a
    collection that frees a threading.local takes that lock again: the call hung a test run. No
    collection may start inside it."""
    seen = []
    real = sys._current_frames
    monkeypatch.setattr(sys, "_current_frames", lambda: seen.append(gc.isenabled()) or real())
    was = gc.isenabled()
    try:
        gc.enable()
        assert threading.get_ident() in stacks.current_frames()
        assert gc.isenabled()
        gc.disable()
        stacks.current_frames()
        assert not gc.isenabled()  # off before, left off
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]


def test_the_collector_comes_back_on_when_reading_fails(monkeypatch):
    def fails():
        raise MemoryError

    monkeypatch.setattr(sys, "_current_frames", fails)
    was = gc.isenabled()
    try:
        gc.enable()
        try:
            stacks.current_frames()
        except MemoryError:
            pass
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
