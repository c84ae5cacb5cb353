"""Files written whole: a failed write (a full disk, Ctrl-C) leaves what was there and nothing
beside it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import pytest

from ringflow import _files


def test_a_file_is_replaced_whole(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old")
    assert _files.write_whole(path, "new") == str(path)
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["r.json"]


def test_a_file_replaced_keeps_its_permissions(tmp_path):
    """The new contents went in under the process's default mode: a private file (0600) became
    one every user could read, and a read-only one became writable."""
    for mode in (0o600, 0o640, 0o444):
        path = tmp_path / f"r{mode:o}.json"
        path.write_text("old")
        os.chmod(path, mode)
        _files.write_whole(path, "new")
        assert path.read_text() == "new" and stat.S_IMODE(os.stat(path).st_mode) == mode
    assert sorted(os.listdir(tmp_path)) == ["r444.json", "r600.json", "r640.json"]


def test_a_file_this_process_may_not_write_is_refused_and_left_as_it_was(tmp_path, monkeypatch):
    """A file whose permissions keep this process from writing it (as open() for writing would
    find) was replaced all the same: moving a new file over a name needs leave to write its
    folder only."""
    path = tmp_path / "r.json"
    path.write_text("old")
    os.chmod(path, 0o444)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(path) and mode == os.W_OK
                        else real_access(p, mode, **kw))  # (as for a user who is not root)
    with pytest.raises(PermissionError, match="read-only") as info:
        _files.write_whole(path, "new")
    assert info.value.filename == str(path)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]


def test_a_symbolic_link_is_written_through_not_replaced(tmp_path):
    """The link was replaced by a regular file, and the file it points to kept the old contents."""
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "r.json"
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(os.path.join("runs", "r.json"))
    assert _files.write_whole(link, "new") == str(link)
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["latest.json", "runs"] and os.listdir(tmp_path / "runs") == ["r.json"]
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(os.path.join("runs", "new.json"))
    _files.write_whole(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "runs" / "new.json").read_text() == "made"


def test_the_contents_reach_the_disk_before_the_name_is_moved_over(tmp_path, monkeypatch):
    """A crash (power loss) just after the move must not leave an empty or partial file under the
    name: a file system may commit the rename before the data, unless the data is synced first."""
    path = tmp_path / "r.json"
    path.write_text("old")
    steps = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        steps.append(("fsync", os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd))
        real_fsync(fd)

    def replace(src, dst):
        steps.append(("replace", os.fspath(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _files.write_whole(path, "new")
    assert [s[0] for s in steps][:2] == ["fsync", "replace"], steps
    assert steps[0][1] == steps[1][1] or not os.path.exists("/proc/self/fd")  # the temporary file's data
    assert path.read_text() == "new"


def test_a_file_system_that_cannot_sync_still_takes_the_file(tmp_path, monkeypatch):
    path = tmp_path / "r.json"

    def fsync(fd):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "fsync", fsync)
    _files.write_whole(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["r.json"]


@pytest.mark.parametrize("name", ["r\0.json", b"r\0.json"], ids=repr)
def test_a_name_with_a_nul_byte_is_an_os_error_that_names_it(tmp_path, name):
    """open()'s bare ValueError, 'embedded null byte', escaped save_trace, plot and every other
    writer, naming no file."""
    path = os.path.join(os.fsencode(tmp_path) if isinstance(name, bytes) else str(tmp_path), name)
    with pytest.raises(OSError, match="a file name cannot hold a NUL byte") as info:
        _files.write_whole(path, "new")
    assert info.value.filename == os.fsdecode(path) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=repr)
def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, failure):
    path = tmp_path / "r.json"
    path.write_text("old")

    class Failing:
        def __init__(self, name, *a, **k):
            self.fh = open(name, "w")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            self.fh.write(text[:3])
            raise failure

    monkeypatch.setattr(_files, "open", Failing, raising=False)
    with pytest.raises(type(failure)) as info:
        _files.write_whole(path, "new contents")
    if isinstance(failure, OSError):
        assert info.value.filename == str(path)  # named, as a failed open is
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]


FULL_DISK = r"""
import resource, sys
import numpy as np
import ringflow as rf
from ringflow._pipeline.whole_array import stream_map_report

_, report = stream_map_report(lambda x, y: np.multiply(x, 2, out=y), np.ones(1 << 16, np.float32),
                              device=rf.device("sim", seed=1), chunk_bytes=1 << 12)
resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))  # a disk that fills after 512 bytes
try:
    report.save_trace(sys.argv[1])
except OSError as exc:
    print("failed:", exc.filename == sys.argv[1], exc.strerror)
"""


def test_a_trace_that_does_not_fit_the_disk_leaves_the_file_as_it_was(tmp_path):
    """It was left cut short, invalid JSON, after the run it recorded."""
    path = tmp_path / "trace.json"
    path.write_text("[]")
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("failed: True"), done.stdout
    assert path.read_text() == "[]" and os.listdir(tmp_path) == ["trace.json"]


def test_a_pipe_is_refused_and_left_as_it_was(tmp_path):
    """A pipe, like a device or a socket, was replaced by a regular file (as root, /dev/null too)."""
    path = str(tmp_path / "t.pipe")
    os.mkfifo(path)
    with pytest.raises(OSError, match="not a regular file") as info:
        _files.write_whole(path, "new")
    assert info.value.filename == path
    assert stat.S_ISFIFO(os.stat(path).st_mode) and os.listdir(tmp_path) == ["t.pipe"]


@pytest.mark.parametrize("name", ["a" * 250 + ".json", "é" * 125 + ".json"], ids=["ascii", "two-byte"])
def test_a_name_as_long_as_the_system_takes_is_written(tmp_path, name):
    """The temporary file beside it was named after it and some ten bytes longer: too long."""
    assert len(os.fsencode(name)) <= os.pathconf(tmp_path, "PC_NAME_MAX")
    _files.write_whole(tmp_path / name, "new")
    assert (tmp_path / name).read_text() == "new" and os.listdir(tmp_path) == [name]


def test_two_threads_writing_one_name_at_once_both_succeed(tmp_path, monkeypatch):
    """Both wrote the same temporary file: the second to move it found it gone."""
    path = tmp_path / "r.json"
    both_open = threading.Barrier(2, timeout=10)
    real_open = open

    def open_and_wait(*a, **k):
        fh = real_open(*a, **k)
        both_open.wait()
        return fh

    monkeypatch.setattr(_files, "open", open_and_wait, raising=False)
    failed = []

    def write(text):
        try:
            _files.write_whole(path, text)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failed.append(exc)

    threads = [threading.Thread(target=write, args=(text,)) for text in ("one", "two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed and path.read_text() in ("one", "two") and os.listdir(tmp_path) == ["r.json"]


@pytest.mark.parametrize("name, shown", [
    ("a\x1b[2Jb", "a\\x1b[2Jb"),  # an escape sequence: the terminal would clear the screen
    ("a\x9b31mb", "a\\x9b31mb"),  # the one-character CSI of the C1 controls
    ("a\r\nb\tc\x00\x7f", "a\\r\\nb\\tc\\x00\\x7f"),
    ("a\u2028b", "a\\u2028b"),
    ("h\u00e9\u20ac [b]", "h\u00e9\u20ac \\[b]"),  # text and markup as before
])
def test_printable_writes_control_characters_as_escapes(name, shown):
    assert _files.printable(name) == shown


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
def test_write_new_takes_the_first_free_name_and_leaves_nothing_else(tmp_path, monkeypatch, links):
    """:func:`_files.write_new` writes under the first name no file holds, on a file system with
    hard links or without, and leaves no temporary file; with every name taken it says so."""
    import errno

    if not links:
        def no_link(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(_files.os, "link", no_link)
    names = [str(tmp_path / f"r{n}.json") for n in (1, 2)]
    assert _files.write_new(names, "one") == names[0]
    assert _files.write_new(names, b"two") == names[1]
    with pytest.raises(FileExistsError):
        _files.write_new(names, "three")
    assert sorted(os.listdir(tmp_path)) == ["r1.json", "r2.json"]
    assert open(names[0]).read() == "one" and open(names[1]).read() == "two"


def test_write_new_interrupted_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(_files.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _files.write_new([str(tmp_path / "r.json")], "x")
    assert os.listdir(tmp_path) == []
