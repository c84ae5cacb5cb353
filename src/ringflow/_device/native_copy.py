"""A memory copy split over native threads, for staging host memory.

Why: one thread copies ordinary memory at a fraction of what the host's memory system moves
(docs/performance.md has the measurements), and staging a request into pinned memory is the
largest part of the time ``submit`` spends per request. numpy
copies on the calling thread only, and Python threads splitting a copy each take the GIL twice
per part, from the very threads that need it (docs/design.md, "Pinned staging and results").
So the copy is split here over threads that never touch the interpreter: a few lines of C,
compiled once per machine with the C compiler Python was built with, called through
:mod:`ctypes` (which lets go of the GIL for the call).

Where no compiler works (or ``RINGFLOW_NATIVE_COPY=0`` is set), :func:`copier` returns None and
callers copy with numpy as before. The library is built into a per-user cache directory
(``RINGFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/ringflow``, else ``~/.cache/ringflow``) under a
name that hashes its source and the platform, written to a temporary name and renamed, so
concurrent first uses are safe.

One copy runs on the pool at a time; a copy that finds the pool busy (another thread's copy)
runs on its own thread alone instead of waiting. After ``fork`` the child starts a fresh pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import subprocess
import sys
import sysconfig
import tempfile
import threading
from typing import Optional

import numpy as np

log = logging.getLogger(__name__)

MAX_THREADS = 32  # the C side's limit

_SOURCE = r"""
#include <pthread.h>
#include <semaphore.h>
#include <string.h>
#include <stddef.h>
#include <errno.h>

#define MAX_THREADS 32
static sem_t start_sem[MAX_THREADS];
static sem_t finished_sem;
static struct { char *dst; const char *src; size_t n; } part[MAX_THREADS];
static int started = 0;
static int registered = 0;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static void wait_sem(sem_t *s) { while (sem_wait(s) != 0 && errno == EINTR) {} }

static void *worker(void *arg) {
    long i = (long)arg;
    for (;;) {
        wait_sem(&start_sem[i]);
        memcpy(part[i].dst, part[i].src, part[i].n);
        sem_post(&finished_sem);
    }
    return NULL;
}

/* the child of a fork has none of the parent's threads: it starts its own pool */
static void child_after_fork(void) {
    started = 0;
    pthread_mutex_init(&call_lock, NULL);
}

static int ensure_helpers(int want) {
    if (!registered) {
        pthread_atfork(NULL, NULL, child_after_fork);
        registered = 1;
    }
    if (started == 0 && sem_init(&finished_sem, 0, 0) != 0) return 0;
    while (started < want) {
        pthread_t t;
        pthread_attr_t attr;
        if (sem_init(&start_sem[started], 0, 0) != 0) break;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(long)started);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        started++;
    }
    return started;
}

/* Copy n bytes from src to dst on up to `threads` threads, the caller's among them; returns the
   threads that copied. Parts are 64-byte aligned; the caller copies the first. */
int ringflow_copy(char *dst, const char *src, size_t n, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || n < (size_t)threads * 4096 || pthread_mutex_trylock(&call_lock) != 0) {
        memcpy(dst, src, n);
        return 1;
    }
    int helpers = ensure_helpers(threads - 1);
    if (helpers > threads - 1) helpers = threads - 1; /* the pool may have more than this call asks */
    size_t parts = (size_t)helpers + 1;
    size_t step = ((n + parts - 1) / parts + 63) & ~(size_t)63; /* parts * step >= n */
    size_t off = step < n ? step : n;
    int used = 0;
    for (int i = 0; i < helpers && off < n; i++) {
        size_t len = n - off < step ? n - off : step;
        part[i].dst = dst + off;
        part[i].src = src + off;
        part[i].n = len;
        off += len;
        used++;
        sem_post(&start_sem[i]);
    }
    memcpy(dst, src, step < n ? step : n);
    for (int i = 0; i < used; i++) wait_sem(&finished_sem);
    pthread_mutex_unlock(&call_lock);
    return used + 1;
}
"""

_lock = threading.Lock()
_loaded: "Optional[ctypes.CDLL] | bool" = None  # None: not tried yet; False: unavailable


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("RINGFLOW_CACHE_DIR")
    if base:
        return pathlib.Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "ringflow"


def _library_path() -> pathlib.Path:
    tag = hashlib.sha256((_SOURCE + platform.platform() + platform.machine()).encode()).hexdigest()[:16]
    return _cache_dir() / f"native_copy-{tag}.so"


def _build(path: pathlib.Path) -> None:
    """Compile the library to ``path``. Raises OSError or subprocess errors where it cannot."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = pathlib.Path(tmp) / "native_copy.c"
        src.write_text(_SOURCE)
        out = pathlib.Path(tmp) / path.name
        subprocess.run([*cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(out), str(src)], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, path)  # atomic: a concurrent first use sees the old name or the whole file


def copier() -> "Optional[ctypes.CDLL]":
    """The loaded library, building it on first use; None where it cannot be had (logged once)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded or None


def _load() -> "ctypes.CDLL | bool":
    if os.environ.get("RINGFLOW_NATIVE_COPY", "1") == "0" or not sys.platform.startswith("linux"):
        log.info("native copies off: copying host memory with numpy on the calling thread")
        return False
    path = _library_path()
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
        lib.ringflow_copy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        lib.ringflow_copy.restype = ctypes.c_int
        return lib
    except Exception as exc:  # noqa: BLE001 - any failure leaves numpy's copy, which always works
        detail = getattr(exc, "stderr", b"") or b""
        log.info("native copies unavailable (%s: %s%s): copying host memory with numpy", type(exc).__name__, exc,
                 f"; {detail.decode(errors='replace').strip()[:300]}" if detail else "")
        return False


def copy(dst: np.ndarray, src: np.ndarray, threads: int) -> bool:
    """Copy C-contiguous ``src`` into C-contiguous ``dst`` of the same bytes on up to ``threads``
    threads; returns False (having copied nothing) where the native copier is unavailable or the
    arrays are not both C-contiguous with equal byte counts."""
    lib = copier()
    if lib is None or not (dst.flags.c_contiguous and src.flags.c_contiguous) or dst.nbytes != src.nbytes:
        return False
    lib.ringflow_copy(dst.ctypes.data, src.ctypes.data, dst.nbytes, int(threads))
    return True
