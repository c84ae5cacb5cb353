"""Small C libraries built once per machine and loaded through :mod:`ctypes`.

A library is compiled from its source with the C compiler Python was built with, into a
per-user cache directory (``RINGFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/ringflow``, else
``~/.cache/ringflow``) under a name that hashes its source and the platform, written to a
temporary name and renamed, so concurrent first uses are safe. Callers decide what to do where
no compiler works (:func:`load` raises): each has a Python way that always works.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import subprocess
import sysconfig
import tempfile


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("RINGFLOW_CACHE_DIR")
    if base:
        return pathlib.Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "ringflow"


def library_path(name: str, source: str) -> pathlib.Path:
    """Where the library ``name`` built from ``source`` is cached on this machine."""
    tag = hashlib.sha256((source + platform.platform() + platform.machine()).encode()).hexdigest()[:16]
    return _cache_dir() / f"{name}-{tag}.so"


def _build(path: pathlib.Path, source: str) -> None:
    """Compile ``source`` to ``path``. Raises OSError or subprocess errors where it cannot."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src = pathlib.Path(tmp) / "source.c"
        src.write_text(source)
        out = pathlib.Path(tmp) / path.name
        subprocess.run([*cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(out), str(src)], check=True,
                       capture_output=True, timeout=120)
        os.replace(out, path)  # atomic: a concurrent first use sees the old name or the whole file


def load(name: str, source: str) -> ctypes.CDLL:
    """The library ``name`` built from ``source``, building it on its first use on this machine.

    Raises:
        OSError, subprocess.SubprocessError: no compiler works, or the library does not load.
    """
    path = library_path(name, source)
    if not path.exists():
        _build(path, source)
    return ctypes.CDLL(str(path))


def failure_detail(exc: BaseException) -> str:
    """A short description of why a library could not be built or loaded, for a log line."""
    detail = getattr(exc, "stderr", b"") or b""
    text = f"{type(exc).__name__}: {exc}"
    return text + (f"; {detail.decode(errors='replace').strip()[:300]}" if detail else "")
