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

The destination of every copy here is pinned staging memory that the device reads next and the
CPU does not read back, so long parts are written with streaming (non-temporal) stores on
x86-64: a plain store first reads each destination line into the caches. See "Streaming
stores for staging copies" in docs/design.md.

One copy runs on the pool at a time; a copy that finds the pool busy (another thread's copy)
runs on its own thread alone instead of waiting. An idle pool thread polls for its next part
for :data:`SPIN_SECONDS` (``RINGFLOW_COPY_SPIN_US`` sets another time) before it sleeps, since
waking a sleeping one costs about what its part of a request-sized copy does. After ``fork``
the child starts a fresh pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
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

from .._checks import check_flag

log = logging.getLogger(__name__)

MAX_THREADS = 32  # the C side's limit
# An idle copy thread polls this long for its next part before it sleeps (see "Copy threads
# that poll" in docs/design.md): waking a sleeping thread costs more than a part of a 1 MiB copy.
SPIN_SECONDS = 200e-6

_SOURCE = r"""
#include <pthread.h>
#include <semaphore.h>
#include <string.h>
#include <stddef.h>
#include <errno.h>
#include <time.h>
#include <sched.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 32
static sem_t wake_sem[MAX_THREADS];
static struct { char *dst; const char *src; size_t n; } part[MAX_THREADS];
static unsigned long gen[MAX_THREADS]; /* the caller bumps gen[i] to hand helper i its part */
static int sleeping[MAX_THREADS];      /* helper i is in, or about to enter, sem_wait */
static int remaining = 0;              /* parts handed out and not yet copied */
static long spin_ns = 0;               /* how long an idle helper polls before it sleeps */
static int streaming = 1;             /* parts of STREAM_MIN bytes or more bypass the caches */
static int started = 0;
static int registered = 0;
/* counters for measurements: copies split over helpers, parts handed to helpers, parts whose
   helper was asleep (its semaphore posted), and nanoseconds callers polled for their helpers'
   parts after copying their own */
static long n_split = 0, n_parts = 0, n_posted = 0, n_waited_ns = 0;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static void wait_sem(sem_t *s) { while (sem_wait(s) != 0 && errno == EINTR) {} }

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* one turn of a polling loop: a pause, and every 64th turn the CPU offered to any other thread
   that wants it (a machine with fewer free CPUs than pollers still makes progress) */
static inline void relax(unsigned *k) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
    if ((++*k & 63) == 0) sched_yield();
}

/* A part of the copy. The destination is pinned staging memory that the device reads next and
   this CPU does not: on x86-64, a part of STREAM_MIN bytes or more is written with streaming
   (non-temporal) stores, which skip reading each destination line into the caches before
   writing it and leave the caches to the caller's working set. The fence makes the stores
   visible before the part is counted done. Elsewhere, and for short parts, memcpy. */
#define STREAM_MIN (16 * 1024)
static void copy_part(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    if (n >= STREAM_MIN && __atomic_load_n(&streaming, __ATOMIC_RELAXED)) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        _mm_sfence();
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* A helper polls for its next part for spin_ns after each copy, then sleeps on its semaphore.
   Sleeping: it says so (sleeping[i] = 1), then looks at gen[i] once more; the caller bumps
   gen[i], then looks at sleeping[i] and posts if it is set. Both are sequentially consistent,
   so either the helper sees the new part or the caller sees it asleep. A post that finds the
   helper awake leaves the semaphore one ahead: the helper's next sleep returns at once and it
   polls again. */
static void *worker(void *arg) {
    long i = (long)arg;
    unsigned long seen = 0; /* gen[i] when it was made: a part handed out before it ran is new */
    for (;;) {
        long until = now_ns() + __atomic_load_n(&spin_ns, __ATOMIC_RELAXED);
        unsigned long g;
        unsigned k = 0;
        while ((g = __atomic_load_n(&gen[i], __ATOMIC_ACQUIRE)) == seen) {
            relax(&k);
            if ((k & 63) == 0 && now_ns() >= until) {
                __atomic_store_n(&sleeping[i], 1, __ATOMIC_SEQ_CST);
                if (__atomic_load_n(&gen[i], __ATOMIC_SEQ_CST) == seen) wait_sem(&wake_sem[i]);
                __atomic_store_n(&sleeping[i], 0, __ATOMIC_SEQ_CST);
                until = now_ns() + __atomic_load_n(&spin_ns, __ATOMIC_RELAXED);
            }
        }
        seen = g;
        copy_part(part[i].dst, part[i].src, part[i].n);
        __atomic_fetch_sub(&remaining, 1, __ATOMIC_ACQ_REL);
    }
    return NULL;
}

/* the child of a fork has none of the parent's threads: it starts its own pool */
static void child_after_fork(void) {
    started = 0;
    remaining = 0;
    n_split = n_parts = n_posted = n_waited_ns = 0;
    pthread_mutex_init(&call_lock, NULL);
}

static int ensure_helpers(int want) {
    if (!registered) {
        pthread_atfork(NULL, NULL, child_after_fork);
        registered = 1;
    }
    while (started < want) {
        pthread_t t;
        pthread_attr_t attr;
        if (sem_init(&wake_sem[started], 0, 0) != 0) break;
        gen[started] = 0;
        sleeping[started] = 0;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(long)started);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        started++;
    }
    return started;
}

/* The counters, in the order declared, into out[0..3]. */
void ringflow_copy_counters(long *out) {
    out[0] = __atomic_load_n(&n_split, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&n_parts, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&n_posted, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&n_waited_ns, __ATOMIC_RELAXED);
}

/* How long (ns) an idle helper polls for work before it sleeps; 0: it sleeps at once. */
void ringflow_copy_spin(long ns) { __atomic_store_n(&spin_ns, ns < 0 ? 0 : ns, __ATOMIC_RELAXED); }

/* Whether long parts are written with streaming stores (1) or memcpy (0). */
void ringflow_copy_streaming(int on) { __atomic_store_n(&streaming, on ? 1 : 0, __ATOMIC_RELAXED); }

/* Copy n bytes from src to dst on up to `threads` threads, the caller's among them; returns the
   threads that copied. Parts are 64-byte aligned; the caller copies the first and then polls
   until the helpers' parts are done (it holds no interpreter lock meanwhile). */
int ringflow_copy(char *dst, const char *src, size_t n, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || n < (size_t)threads * 4096 || pthread_mutex_trylock(&call_lock) != 0) {
        copy_part(dst, src, n);
        return 1;
    }
    int helpers = ensure_helpers(threads - 1);
    if (helpers > threads - 1) helpers = threads - 1; /* the pool may have more than this call asks */
    size_t parts = (size_t)helpers + 1;
    size_t step = ((n + parts - 1) / parts + 63) & ~(size_t)63; /* parts * step >= n */
    size_t first = step < n ? step : n;
    int used = 0;
    for (size_t off = first; used < helpers && off < n; used++) off += n - off < step ? n - off : step;
    __atomic_store_n(&remaining, used, __ATOMIC_RELEASE);
    size_t off = first;
    for (int i = 0; i < used; i++) {
        size_t len = n - off < step ? n - off : step;
        part[i].dst = dst + off;
        part[i].src = src + off;
        part[i].n = len;
        off += len;
        __atomic_fetch_add(&gen[i], 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&sleeping[i], __ATOMIC_SEQ_CST)) {
            sem_post(&wake_sem[i]);
            __atomic_fetch_add(&n_posted, 1, __ATOMIC_RELAXED);
        }
    }
    copy_part(dst, src, first);
    long t0 = now_ns();
    unsigned k = 0;
    while (__atomic_load_n(&remaining, __ATOMIC_ACQUIRE) != 0) relax(&k);
    __atomic_fetch_add(&n_waited_ns, now_ns() - t0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&n_split, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&n_parts, used, __ATOMIC_RELAXED);
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
        lib.ringflow_copy_spin.argtypes = (ctypes.c_long,)
        lib.ringflow_copy_spin.restype = None
        lib.ringflow_copy_spin(int(_spin_from_env() * 1e9))
        lib.ringflow_copy_counters.argtypes = (ctypes.POINTER(ctypes.c_long),)
        lib.ringflow_copy_counters.restype = None
        lib.ringflow_copy_streaming.argtypes = (ctypes.c_int,)
        lib.ringflow_copy_streaming.restype = None
        lib.ringflow_copy_streaming(int(os.environ.get("RINGFLOW_COPY_STREAMING", "1") != "0"))
        return lib
    except Exception as exc:  # noqa: BLE001 - any failure leaves numpy's copy, which always works
        detail = getattr(exc, "stderr", b"") or b""
        log.info("native copies unavailable (%s: %s%s): copying host memory with numpy", type(exc).__name__, exc,
                 f"; {detail.decode(errors='replace').strip()[:300]}" if detail else "")
        return False


def _spin_from_env() -> float:
    """Seconds an idle copy thread polls before it sleeps: ``RINGFLOW_COPY_SPIN_US``
    (microseconds) where set to a number from 0 to 10^6, else :data:`SPIN_SECONDS`."""
    raw = os.environ.get("RINGFLOW_COPY_SPIN_US")
    if raw is None:
        return SPIN_SECONDS
    try:
        us = float(raw)
    except ValueError:
        us = math.nan
    if not 0 <= us <= 1e6:
        log.warning("RINGFLOW_COPY_SPIN_US=%r is not a number of microseconds from 0 to 1000000; using %g",
                    raw, SPIN_SECONDS * 1e6)
        return SPIN_SECONDS
    return us * 1e-6


def set_spin(seconds: float) -> None:
    """How long an idle copy thread polls for its next part before it sleeps (0: at once); for
    measurements. Raises ValueError outside 0 to 1 s; does nothing where native copies are off."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 1:
        raise ValueError(f"seconds must be a number from 0 to 1, got {seconds!r}")
    lib = copier()
    if lib is not None:
        lib.ringflow_copy_spin(int(seconds * 1e9))


def set_streaming(on: bool) -> None:
    """Whether long parts of a copy are written with streaming stores (True, the default; see
    "Streaming stores for staging copies" in docs/design.md) or with ``memcpy``; for
    measurements (``RINGFLOW_COPY_STREAMING=0`` starts with them off). Raises TypeError for
    anything but a bool; does nothing where native copies are off."""
    on = check_flag("on", on)
    lib = copier()
    if lib is not None:
        lib.ringflow_copy_streaming(int(on))


def copy(dst: np.ndarray, src: np.ndarray, threads: int) -> bool:
    """Copy C-contiguous ``src`` into C-contiguous ``dst`` of the same bytes on up to ``threads``
    threads; returns False (having copied nothing) where the native copier is unavailable or the
    arrays are not both C-contiguous with equal byte counts."""
    lib = copier()
    if lib is None or not (dst.flags.c_contiguous and src.flags.c_contiguous) or dst.nbytes != src.nbytes:
        return False
    lib.ringflow_copy(dst.ctypes.data, src.ctypes.data, dst.nbytes, int(threads))
    return True


COUNTER_NAMES = ("split_copies", "helper_parts", "sleeping_helpers_called", "caller_wait_ns")


def counters() -> dict:
    """Totals since the process started (or forked), for measurements: copies split over
    threads, parts handed to helper threads, parts whose helper was asleep when it was handed
    one, and nanoseconds callers polled for their helpers' parts after copying their own. All
    zero where native copies are off."""
    lib = copier()
    out = (ctypes.c_long * len(COUNTER_NAMES))()
    if lib is not None:
        lib.ringflow_copy_counters(out)
    return dict(zip(COUNTER_NAMES, (int(v) for v in out)))
