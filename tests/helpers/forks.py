"""What a forked child in a test's subprocess script does last: report and leave."""

from __future__ import annotations

import os
import sys


def leave_child(lines: list) -> None:
    """Write ``lines`` (one each) to stdout for the parent test to read, then end the forked child
    at once with status 0: ``os._exit``, so that nothing the parent set up (its atexit hooks, its
    objects' finalisers) runs a second time in the child."""
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    os._exit(0)
