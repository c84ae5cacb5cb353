"""Files ringflow reads and writes for the user (a trace, bench results, a doctor report, a
hardware profile). Each is written whole: a reader never sees half of one, a write that fails
(a full disk, Ctrl-C) leaves the file as it was and nothing beside it, and the contents are on
the disk before the name points at them. A name that is a device,
pipe or socket is refused by every reader and writer alike (:func:`is_special`)."""

from __future__ import annotations

import errno
import io
import os
import re
import stat
import threading
from typing import Any, Iterable


def check_file_name(path: Any, where: str, *, file_objects: bool = False) -> None:
    """Refuse a ``path`` that is not a file name (a str, bytes or ``os.PathLike``; with
    ``file_objects`` also an open binary file, anything with ``write`` but a text file).
    ``open()`` takes an int as a file descriptor: ``save_trace(1)`` would write over stdout and
    then close it.

    Raises:
        TypeError: naming ``where`` and what it got.
    """
    # an open text file takes no bytes: what goes in is an image, so it would fail half-written
    if isinstance(path, (str, bytes, os.PathLike)) or (file_objects and hasattr(path, "write")
                                                        and not isinstance(path, io.TextIOBase)):
        return
    also = " or an open binary file" if file_objects else ""
    raise TypeError(f"{where}: path must be a file name (a str or os.PathLike{also}), got "
                    f"{type(path).__name__} {path!r:.60}")


def write_whole(path: "str | os.PathLike", text: "str | bytes") -> str:
    """Write ``text`` (a str as UTF-8, or bytes as they are) to a file beside ``path``, then move
    it over ``path``. The file replaced keeps its permissions, and a symbolic link is written
    through (the file it names gets the contents; the link stays).

    Returns:
        ``path`` as a string.

    Raises:
        OSError: the file cannot be written, or ``path`` names a device, pipe or socket
            (:func:`is_special`); the error names ``path``.
        PermissionError: ``path`` is a file this process may not write (read-only), as ``open``
            would find it; it is left as it was.
    """
    path = os.fsdecode(path)
    if "\0" in path:  # open() would say only "embedded null byte", naming no file
        raise OSError(errno.EINVAL, "a file name cannot hold a NUL byte", path)
    if is_special(path):  # replaced by a regular file otherwise: a pipe, or as root /dev/null
        raise OSError(errno.EINVAL, "not a regular file (a device, pipe or socket); give the name of a "
                      "regular file to write", path)
    # moving a new file over a name needs leave to write its folder only: the name's own file
    # decides as it would for open(), and gives the new one its mode (a private file stays private)
    target = os.path.realpath(path) if os.path.islink(path) else path
    mode = None
    if os.path.isfile(target):
        if not os.access(target, os.W_OK):
            raise PermissionError(errno.EACCES, "the file is read-only (its permissions keep this process from "
                                  "writing it); make it writable, or give another name", path)
        mode = stat.S_IMODE(os.stat(target).st_mode)
    tmp = _temporary_name(target)
    try:
        _write_synced(tmp, text, mode)
        os.replace(tmp, target)
    except BaseException as exc:  # a failed write, or Ctrl-C: the temporary file goes too
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, path) from None
        raise
    return path


def write_new(paths: "Iterable[str]", text: "str | bytes") -> str:
    """Write ``text`` (as :func:`write_whole` does) under the first of ``paths`` (names in one
    folder) that no file holds yet, first come first served among writers at once. The name
    appears with the whole contents: they go to a file beside it first, which then gets the name
    by a hard link, refused where the name is taken. Where the file system has no hard links,
    the name is taken by an empty file first and the contents moved over it.

    Returns:
        The path written.

    Raises:
        FileExistsError: every one of ``paths`` is taken (naming the first).
        OSError: the file cannot be written (nothing is left behind; the error names the path).
    """
    paths = [os.fsdecode(p) for p in paths]
    tmp = _temporary_name(paths[0])
    try:
        try:
            _write_synced(tmp, text, None)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, paths[0]) from None
        for i, path in enumerate(paths):
            try:
                os.link(tmp, path)
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno in _NO_LINKS:
                    return _write_new_without_links(paths[i:], text)
                raise OSError(exc.errno, exc.strerror, path) from None
            return path
    finally:  # a failed write, or Ctrl-C, or the contents now under their name: the temporary name goes
        try:
            os.unlink(tmp)
        except OSError:
            pass
    raise FileExistsError(errno.EEXIST, "every name is taken", paths[0])


# what os.link raises on a file system without hard links (FAT, some FUSE and network ones)
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)


def _write_new_without_links(paths: "list[str]", text: "str | bytes") -> str:
    """:func:`write_new` where no hard link can be made: each name is taken by an empty file
    (refused where it is taken) before the contents are moved over it whole."""
    for path in paths:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            continue
        try:
            return write_whole(path, text)
        except BaseException:  # a failed write, or Ctrl-C: the name taken is given back
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
    raise FileExistsError(errno.EEXIST, "every name is taken", paths[0])


def _write_synced(tmp: str, text: "str | bytes", mode: "int | None") -> None:
    """Write ``text`` (a str as UTF-8) to the new file ``tmp`` (given ``mode``, where not None)
    and have it on the disk before any name points at it: a file system may commit a rename or
    a link first, and a crash between the two would leave an empty file under the name."""
    binary = isinstance(text, bytes)
    with open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as fh:
        if mode is not None:
            os.chmod(tmp, mode)
        fh.write(text)
        fh.flush()
        try:
            os.fsync(fh.fileno())
        except OSError as exc:  # a file system that cannot sync (some FUSE ones) still takes the file
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise


def _temporary_name(path: str) -> str:
    """A name beside ``path`` (so that moving it over ``path`` is atomic) for the contents until
    they are whole: ``path``'s name with this process and thread added, which makes it one per
    writer at a time, and cut short where the whole would be longer than the folder takes."""
    folder, name = os.path.split(path)
    tag = f".tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        most = os.pathconf(folder or os.curdir, "PC_NAME_MAX")
    except (OSError, ValueError):  # a missing folder (the write names it) or no limit known
        most = 255
    while name and len(os.fsencode(f".{name}{tag}")) > most:
        name = name[:-1]
    return os.path.join(folder, f".{name}{tag}")


def is_special(path: "str | os.PathLike") -> bool:
    """Whether ``path`` names something that is neither a folder nor a regular file: a device
    (``/dev/zero``, ``/dev/full``), a pipe or a socket, which a read or write might never end,
    or end only after the whole run. False for a missing name."""
    return os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path)


def too_large(path: "str | os.PathLike") -> str:
    """Words for a file that ran the process out of memory as it was read: the file and its size."""
    try:
        size = f"{os.stat(path).st_size} bytes"
    except OSError:
        size = "size unknown"
    return f"{os.fspath(path)!r} is too large to read into the memory free ({size})"


# what a terminal takes as a control sequence (ESC, CSI) or a line break, not as text: the C0 and
# C1 controls, DEL, and the line and paragraph separators
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def controls_escaped(text: str) -> str:
    """``text`` with each control character and line or paragraph separator written as its
    escape (``\\x1b``, ``\\n``, ``\\u2028``), everything else as it is."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def printable(text: str) -> str:
    """``text`` (a file's name, or a name read from a file) as rich prints it literally: each
    control character and lone surrogate written as its escape (``\\x1b``, ``\\n``,
    ``\\ud800``) and rich markup escaped (``[b]`` shown as written)."""
    from rich.markup import escape

    # a name read from a file may hold an escape sequence, which the terminal would run (colours,
    # a window title, a cleared screen), or a line break, which splits a table's row
    text = controls_escaped(text)
    # JSON may hold a lone surrogate ("\ud800"), and a file name undecodable bytes (which Python
    # reads as surrogates): no encoding can write one, so the console would fail on it
    return escape(text.encode("utf-8", "backslashreplace").decode("utf-8"))
