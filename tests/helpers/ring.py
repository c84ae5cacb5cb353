"""A correctly synchronised three-stream copy -> compute -> copy loop over a ring of slots.

Four rings of ``slots`` buffers each (host-in, device-in, device-out, host-out); chunk ``i``
uses slot ``i % slots``. Three streams: one for H2D, one for compute, one for D2H. The host
fills a host-in slot, and later reads the host-out slot back ("consumes" the chunk).

Every ordering the loop needs is one call at one of six *points*, listed in ``POINTS``. A test
drops one, by parameter, to check that the simulator catches the bug it makes:

``drop="compute_waits_h2d"``          drops that point for every chunk (the line deleted);
``drop=("compute_waits_h2d", 5)``     drops only chunk 5's instance.

``RingRun.executed`` lists every (point, chunk) instance the loop performed, so a test can
enumerate them all. Nothing here edits the simulator; the loop is ordinary user code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

# point -> what it orders (the hazard its absence creates)
POINTS: dict[str, str] = {
    "host_syncs_h2d_before_refill": "host sync: the H2D that read host-in[k] is done before the host refills it (WAR)",
    "h2d_waits_compute_done": "stream wait: the kernel that read device-in[k] is done before the next H2D overwrites it (WAR)",
    "compute_waits_h2d": "stream wait: the H2D into device-in[k] is done before the kernel reads it (RAW)",
    "compute_waits_d2h_done": "stream wait: the D2H that read device-out[k] is done before the next kernel overwrites it (WAR)",
    "d2h_waits_compute": "stream wait: the kernel that wrote device-out[k] is done before the D2H reads it (RAW)",
    "host_syncs_d2h_before_consume": "host sync: the D2H into host-out[k] is done before the host reads it (RAW)",
}
WAIT_POINTS = tuple(p for p in POINTS if "_waits_" in p)
SYNC_POINTS = tuple(p for p in POINTS if "_syncs_" in p)

OBSERVE_STYLES = ("sync", "is_done", "wait_any")


def kernel(x: np.ndarray, y: np.ndarray) -> None:
    """The compute stage: y = 3x + 1 (float32, bit-exact against ``reference``)."""
    np.multiply(x, np.float32(3), out=y)
    y += np.float32(1)


def reference(x: np.ndarray) -> np.ndarray:
    y = np.empty_like(x)
    kernel(x, y)
    return y


@dataclasses.dataclass
class RingRun:
    inputs: np.ndarray  # (chunks, elems) float32
    outputs: np.ndarray  # what the host read back
    executed: list  # every (point, chunk) instance performed, in program order
    dropped: list  # the instances skipped because of ``drop``

    @property
    def expected(self) -> np.ndarray:
        return reference(self.inputs)

    @property
    def ok(self) -> bool:
        """Bit-exact: every chunk's output equals the reference on its input."""
        return bool(np.array_equal(self.outputs.view(np.uint32), self.expected.view(np.uint32)))


def observe(dev: Any, event: Any, style: str) -> None:
    """Make the host wait for ``event`` the way ``style`` says; each orders the host after it."""
    if style == "sync":
        event.sync()
    elif style == "is_done":
        for _ in range(1_000_000):  # each query costs the profile's event overhead in virtual time
            if event.is_done:
                return
        raise AssertionError(f"polling {event!r} never saw it done: does event.is_done advance virtual time?")
    elif style == "wait_any":
        done = dev.wait_any([event])
        assert done == [event], done
    else:
        raise ValueError(f"unknown observe style {style!r}; use one of {OBSERVE_STYLES}")


def run_ring(dev: Any, *, chunks: int = 12, slots: int = 3, elems: int = 1024, drop: Any = None,
             kernel_seconds: float | None = None, observe_style: str = "sync", data_seed: int = 0,
             fn: Callable[[np.ndarray, np.ndarray], None] = kernel, close: bool = True) -> RingRun:
    """Run the loop on ``dev``; raises whatever the device raises (HazardError for a dropped point
    with the checker on). ``kernel_seconds`` fixes the compute stage's virtual duration."""
    if drop is not None:
        name = drop if isinstance(drop, str) else drop[0]
        if name not in POINTS:
            raise ValueError(f"unknown point {name!r}; choose one of {list(POINTS)}")
    rng = np.random.default_rng(data_seed)
    inputs = rng.standard_normal((chunks, elems)).astype(np.float32)
    outputs = np.full((chunks, elems), np.nan, np.float32)
    nbytes = elems * 4
    executed: list = []
    dropped: list = []

    def at(point: str, chunk: int) -> bool:
        """True when the loop should perform ``point`` for ``chunk`` (False: the test dropped it)."""
        executed.append((point, chunk))
        if drop == point or drop == (point, chunk):
            dropped.append((point, chunk))
            return False
        return True

    s_h2d, s_comp, s_d2h = dev.create_stream(), dev.create_stream(), dev.create_stream()
    h_in = [dev.allocate_host(nbytes) for _ in range(slots)]
    d_in = [dev.allocate(nbytes) for _ in range(slots)]
    d_out = [dev.allocate(nbytes) for _ in range(slots)]
    h_out = [dev.allocate_host(nbytes) for _ in range(slots)]
    h2d_done: list = [None] * slots  # per slot: event after the last H2D that used it
    comp_done: list = [None] * slots
    d2h_done: list = [None] * slots
    chunk_in_slot: list = [None] * slots  # which chunk's result host-out[k] will hold

    def consume(k: int) -> None:
        j = chunk_in_slot[k]
        if at("host_syncs_d2h_before_consume", j):
            observe(dev, d2h_done[k], observe_style)
        outputs[j] = h_out[k].view(np.float32, access="r")

    for i in range(chunks):
        k = i % slots
        # prepare: refill host-in[k] once the H2D that last read it is done
        if h2d_done[k] is not None and at("host_syncs_h2d_before_refill", i):
            observe(dev, h2d_done[k], observe_style)
        h_in[k].view(np.float32, access="w")[:] = inputs[i]
        # h2d: into device-in[k] once the kernel that last read it is done
        if comp_done[k] is not None and at("h2d_waits_compute_done", i):
            s_h2d.wait(comp_done[k])
        s_h2d.copy(d_in[k], h_in[k])
        h2d_done[k] = s_h2d.record()
        # compute: after this chunk's H2D, and once the D2H that last read device-out[k] is done
        if at("compute_waits_h2d", i):
            s_comp.wait(h2d_done[k])
        if d2h_done[k] is not None and at("compute_waits_d2h_done", i):
            s_comp.wait(d2h_done[k])
        s_comp.launch(fn, d_in[k].array(np.float32, elems), d_out[k].array(np.float32, elems),
                      reads=[d_in[k]], writes=[d_out[k]], sim_seconds=kernel_seconds)
        comp_done[k] = s_comp.record()
        # consume the previous chunk of this slot before its host-out is overwritten
        if chunk_in_slot[k] is not None:
            consume(k)
        # d2h: after this chunk's kernel
        if at("d2h_waits_compute", i):
            s_d2h.wait(comp_done[k])
        s_d2h.copy(h_out[k], d_out[k])
        d2h_done[k] = s_d2h.record()
        chunk_in_slot[k] = i
    # drain: consume what is still in flight, oldest first
    for i in range(max(0, chunks - slots), chunks):
        consume(i % slots)

    if close:
        for buf in h_in + d_in + d_out + h_out:
            buf.close()
        for s in (s_h2d, s_comp, s_d2h):
            s.close()
    return RingRun(inputs, outputs, executed, dropped)
