"""A thread pool made on first use and shared by every caller in the process
(:class:`SharedThreads`), which a forked child replaces with its own."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Optional


class SharedThreads:
    """``ThreadPoolExecutor(max_workers, thread_name_prefix)``, made by the first :meth:`get`
    and returned by every later one.

    After ``fork()``, in the child, the pool is forgotten and the next :meth:`get` makes a new
    one: the inherited pool's threads are the parent's and are not in the child, yet it would
    count those that were idle as ready and queue the child's work for them, which nothing would
    ever run. The lock is made anew too (a parent's thread, absent from the child, may have held
    it)."""

    def __init__(self, max_workers: int, thread_name_prefix: str):
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
            os.register_at_fork(after_in_child=self._forget)

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        """The pool, made now if this process has none yet."""
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(self._max_workers,
                                                                       thread_name_prefix=self._prefix)
                pool = self._pool
        return pool

    def _forget(self) -> None:
        self._pool, self._lock = None, threading.Lock()
