"""What both engines do the same way on the GPU side: the stage streams, the compute launch
and its error wrapping, poison-after-use in checked mode, and the profiling marks.

The scheduler (:mod:`.scheduler`) and the direct engine (:mod:`.direct`) differ only in who
decides when each operation is enqueued; the operations themselves are made here, once.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Optional

from .._device.protocol import MAX_SIM_SECONDS, Device, Event, Stream, close_quietly, stream_after
from .._errors import DeviceError, StageError, describe

POISON_BYTE = 0xEE  # what checked mode writes into every released slot
GPU_STAGES = ("h2d", "compute", "d2h")


class StageStreams:
    """The streams of one engine: ``h2d``, ``compute`` (and ``computes``, ``compute`` first, when
    kernels of different chunks may run side by side), ``d2h``, and ``poison`` (checked mode
    only) on which released slots are overwritten.

    Built all or nothing: a failure while creating one closes those already made."""

    def __init__(self, device: Device, *, checked: bool, computes: int = 1):
        self.all: list[Stream] = []
        try:
            self.h2d = self._new(device)
            self.compute = self._new(device)
            self.computes = [self.compute] + [self._new(device) for _ in range(max(1, computes) - 1)]
            self.d2h = self._new(device)
            self.poison = self._new(device) if checked else None
        except BaseException:
            self.close()
            raise

    def _new(self, device: Device) -> Stream:
        s = device.create_stream()
        self.all.append(s)
        return s

    @property
    def closed(self) -> bool:
        return not self.all

    def free_after(self) -> Optional[Stream]:
        """A stream on which a stream-ordered free comes after all work enqueued so far (see
        :func:`~ringflow._device.protocol.stream_after`); None when closed or broken."""
        return stream_after(self.all)

    def settle(self) -> None:
        """Block until everything enqueued has completed; never raises (a broken device
        completes nothing more, and its error is reported where the work is)."""
        for s in self.all:
            try:
                s.sync()
            except Exception:  # noqa: BLE001 - settling must not mask the error being handled
                pass

    def close(self) -> None:
        """Close every stream; harmless twice; never raises."""
        streams, self.all = self.all, []
        for s in streams:
            close_quietly(s, "stream")


def poison_after(poison: Stream, where, last_use: Optional[Event]) -> Event:
    """Overwrite ``where`` with :data:`POISON_BYTE` on ``poison`` after ``last_use`` (no wait when
    None: only a switched-off guard passes None); returns the event the slot's next owner waits on.
    A premature reuse then reads poison instead of the previous chunk's data."""
    if last_use is not None:
        poison.wait(last_use)
    poison.fill(where, POISON_BYTE)
    return poison.record()


def writes_into_y(compute: Callable) -> Callable:
    """``compute`` wrapped so that returning anything but None or ``y`` itself is an error: a
    compute must write its result into ``y``; a returned array would be dropped and ``y`` copied
    back unwritten. (``np.add(x, 1, out=y)`` returns ``y``, which is fine.) A kernel's fast launch
    path (``__ringflow_launch__``) is kept."""
    if getattr(compute, "_ringflow_writes_into_y", False):
        return compute

    def checked(x: Any, y: Any) -> None:
        value = compute(x, y)
        if value is not None and value is not y:
            raise TypeError(f"compute returned a value ({type(value).__name__}) instead of writing into y; write the "
                            "result into y (y[...] = ...) and return None")

    checked._ringflow_writes_into_y = True  # type: ignore[attr-defined]
    checked.sim_seconds = getattr(compute, "sim_seconds", None)  # type: ignore[attr-defined]
    fast = getattr(compute, "__ringflow_launch__", None)
    if fast is not None:
        checked.__ringflow_launch__ = fast  # type: ignore[attr-defined]
    return checked


def launch_compute(stream: Stream, compute: Callable, x: Any, y: Any, *, inplace: bool,
                   sim_seconds: Optional[float], index: int, trees: Optional[tuple] = None) -> None:
    """Enqueue ``compute(x, y)`` on ``stream`` (``compute(x, x)`` in place). With ``trees``
    (``(x_tree, y_tree)``, see :mod:`.trees`), ``x`` and ``y`` are lists of leaf arguments and
    compute gets each structure rebuilt from them.

    The launch names ``x`` read and ``y`` written; in place, ``x`` both: the kernel reads each
    byte and writes it back. A compute of no declared cost then takes on the simulated GPU what
    the planner gives it, ``HardwareProfile.kernel_seconds`` of the chunk's input and result bytes.

    Raises:
        StageError: the compute failed while being enqueued, or the device refused the launch
            (not sticky); ``__cause__`` is the original error. A KeyboardInterrupt or SystemExit
            the compute raises is one too (:func:`is_interrupt` of the cause): on a GPU the
            compute runs as it is launched, on whichever thread drives the engine, and an
            interrupt there fails its chunk as one raised on the simulated GPU's clock does.
        DeviceError: a sticky device error: the context is dead and the engine must break.
    """
    try:
        if trees is not None:
            _launch_trees(stream, compute, x, y, trees, inplace=inplace, sim_seconds=sim_seconds)
        elif inplace:
            stream.launch(compute, x, x, reads=[x], writes=[x], sim_seconds=sim_seconds)
        else:
            stream.launch(compute, x, y, reads=[x], writes=[y], sim_seconds=sim_seconds)
    except DeviceError as err:
        if err.sticky:
            raise
        raise StageError("compute", index, err) from err
    except BaseException as exc:  # noqa: BLE001 - the user's compute raised while it was enqueued
        raise StageError("compute", index, exc) from exc


def is_interrupt(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` is a BaseException that is not an Exception (KeyboardInterrupt,
    SystemExit): what a whole-array call raises itself rather than inside a StageError, which
    an ``except Exception`` would swallow."""
    return exc is not None and not isinstance(exc, Exception)


def _launch_trees(stream: Stream, compute: Callable, xs: list, ys: list, trees: tuple, *, inplace: bool,
                  sim_seconds: Optional[float]) -> None:
    """One launch of ``compute`` over structures of leaves: the backend hands the leaves over as
    its arrays, and ``compute`` gets them back in their structures."""
    from .trees import unflatten

    x_tree, y_tree = trees
    k = len(xs)
    if inplace:
        def each(*arrays):
            x = unflatten(x_tree, arrays)
            return compute(x, x)

        stream.launch(each, *xs, reads=xs, writes=xs, sim_seconds=sim_seconds)
        return

    def both(*arrays):
        return compute(unflatten(x_tree, arrays[:k]), unflatten(y_tree, arrays[k:]))

    stream.launch(both, *xs, *ys, reads=xs, writes=ys, sim_seconds=sim_seconds)


def mark(stream: Stream, stage: str, events: Optional[dict], *, start: bool = False,
         device: Optional[Device] = None) -> Optional[Event]:
    """Record the event that ends ``stage`` on ``stream`` (a timing event when ``events`` is given:
    profiling; it is kept there as ``stage + ".end"``). With ``start``, record the profiling start
    event ``stage + ".start"``, or nothing when not profiling, and return None. When profiling
    with ``device``, the end also keeps the host time before its event as ``stage + ".enqueued"``:
    the stage's operation had been enqueued by then, and its start event may have completed long
    before, while the stream waited for the host (:meth:`~ringflow._trace.timeline.Anchor.span_of`)."""
    if start:
        if events is not None:
            events[stage + ".start"] = stream.record(timing=True)
        return None
    if events is not None and device is not None:
        events[stage + ".enqueued"] = device.now
    event = stream.record(timing=events is not None)
    if events is not None:
        events[stage + ".end"] = event
    return event


def sim_seconds_for(cost, nbytes: int) -> Optional[float]:
    """A compute callable's ``sim_seconds`` (seconds, or a function of the chunk's bytes) for a
    chunk of ``nbytes``; None when it has none.

    Raises:
        ValueError: the cost (or what its function returned) is not a number of seconds from 0
            to :data:`MAX_SIM_SECONDS`, or its function raised (the cause is chained).
    """
    if cost is None:
        return None
    try:
        value = cost(nbytes) if callable(cost) else cost
    except Exception as exc:
        raise ValueError(f"the compute's {_cost_name(cost, nbytes)} raised {describe(exc)}; sim_seconds "
                         "must be seconds or a function of a chunk's bytes that returns them") from exc
    if type(value) is float and 0 <= value <= MAX_SIM_SECONDS:  # the usual case, checked first: it runs per launch
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= MAX_SIM_SECONDS:
        raise ValueError(f"the compute's {_cost_name(cost, nbytes)} must be a number of seconds from 0 to "
                         f"{MAX_SIM_SECONDS:g}, got {value!r}; give seconds (a number) or a function of a chunk's "
                         "bytes that returns them")
    return float(value)


def _cost_name(cost, nbytes: int) -> str:
    return f"sim_seconds({nbytes})" if callable(cost) else "sim_seconds"
