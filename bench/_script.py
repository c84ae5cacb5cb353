"""What the measurement scripts under bench/ share: the header every result file carries, a
pinned float32 input of fresh random values, and writing the result."""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any, Optional

import numpy as np

import ringflow as rf
from ringflow._bench.provenance import provenance


def header(machine: Any) -> dict:
    """The date, the machine, the command, ringflow's version and which source ran (the package's
    digest and git commit), for a result file."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine, "command": "python3 " + " ".join(sys.argv), "ringflow": rf.__version__,
            **provenance()}


def pinned_random(dev: Any, mib: int, seed: int = 0) -> tuple:
    """``(buffer, x)``: ``mib`` MiB of pinned memory on ``dev`` and a float32 view of it holding fresh
    random values in [0.5, 1.5)."""
    n = mib * (1 << 20) // 4
    hb = dev.allocate_host(n * 4)
    x = hb.view(np.float32, access="rw")
    x[:] = np.random.default_rng(seed).uniform(0.5, 1.5, n).astype(np.float32)
    return hb, x


def write(out: dict, path: Optional[str]) -> None:
    """Write ``out`` as JSON to ``path`` (nothing when None)."""
    if path:
        with open(path, "w") as fh:
            fh.write(json.dumps(out, indent=1))
