"""Files written whole: a failed write (a full disk, Ctrl-C) leaves what was there and nothing
beside it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ringflow import _files


def test_a_file_is_replaced_whole(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old")
    assert _files.write_whole(path, "new") == str(path)
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["r.json"]


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
