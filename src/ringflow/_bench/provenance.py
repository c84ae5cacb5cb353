"""Which source a measurement ran: a digest of the package's own files, and the git commit
when the tree is a checkout.

A result file names its commit, but a copy of the tree on another machine may carry a stale
``.git`` or none at all; the digest is computed from the files that ran, so a result can be
matched to its commit afterwards (``git stash; git checkout C``, then compare
:func:`source_digest`)."""

from __future__ import annotations

import hashlib
import pathlib
import subprocess
from typing import Any, Optional

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent


def source_digest(root: Optional[pathlib.Path] = None) -> str:
    """The first 16 hex digits of a SHA-256 over every ``.py`` file under ``root`` (the ringflow
    package by default): each file's path relative to ``root``, then its bytes, in path order.
    The same files give the same digest on any machine."""
    root = pathlib.Path(root) if root is not None else _PACKAGE
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _git(args: list, cwd: pathlib.Path) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance(root: Optional[pathlib.Path] = None) -> dict[str, Any]:
    """``{"source_digest": ..., "git_commit": ..., "git_dirty": ...}``: the package's digest, and
    where the package lies in a git checkout, its ``HEAD`` and whether the package's files differ
    from it (None for both otherwise; a stale ``.git`` is caught by the digest, not by these)."""
    root = pathlib.Path(root) if root is not None else _PACKAGE
    commit = _git(["rev-parse", "HEAD"], root)
    dirty = None
    if commit is not None:
        status = _git(["status", "--porcelain", "--", "."], root)
        dirty = None if status is None else bool(status)
    return {"source_digest": source_digest(root), "git_commit": commit, "git_dirty": dirty}
