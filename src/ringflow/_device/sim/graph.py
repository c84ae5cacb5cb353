"""Graph capture and replay on the simulated GPU.

A capture records the calls made on the capturing streams (which op, on which stream, with
which arguments) instead of running them, and keeps CUDA's rules for what may happen meanwhile.
A launch's callable is called at once, as a GPU calls it (host code enqueueing kernels), with
stand-ins for its arrays: what it does to them is recorded (:mod:`.tape`), and a replay runs
that record on the buffers' contents then, never the callable, so the host values it read are
frozen at the capture, as on a GPU. The rules:
a stream joins by waiting on an event recorded during the capture, every joined stream must be
joined back before the capture ends, and an event recorded during the capture may be waited on
but never queried or synced, and neither a capturing stream nor the device may be synchronised
on the capturing thread (a launched callable included). Breaking a rule abandons the capture,
as the driver invalidates it. A launch replays the calls on streams private to the graph
("lanes", one per captured stream), so its work is ordered only by the captured waits and by
the launching stream, as a real graph's nodes are, and every replayed access goes through the
happens-before checker. The host pays one launch's overhead for the whole replay.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional

from ..._errors import CaptureError
from ..protocol import Event, Graph

if TYPE_CHECKING:
    from .device import SimDevice
    from .stream import SimStream


# why a synchronisation abandons a capture, and what to do instead
SYNC_IN_CAPTURE = ("a GPU refuses to synchronise during a stream capture (cudaErrorStreamCaptureUnsupported) and "
                   "abandons it; synchronise before the capture begins or after it ends, never in a captured callable")


class SimCapture:
    """One capture in progress: its streams ("lanes", the origin first) and the calls made."""

    def __init__(self, dev: "SimDevice", origin: "SimStream"):
        self.dev = dev
        self.origin = origin
        self.thread = threading.get_ident()
        self.lanes: list = [origin]
        self.calls: list[tuple[int, str, tuple, dict, Optional["CapturedEvent"]]] = []
        self.work: dict = {origin: 0}  # captured operations per stream (records excluded)
        self.joined: dict = {}  # stream -> its operations that another lane has waited for
        self.reason: Optional[str] = None  # why the capture was abandoned
        self.shadows: dict = {}  # what the launches' recorded work ran on while captured (tape.py)
        self.ended = False

    def abandon(self, reason: str) -> CaptureError:
        """Mark the capture abandoned (the first reason stays) and return the error to raise."""
        if self.reason is None:
            self.reason = reason
        return CaptureError(f"capture abandoned: {self.reason}")

    def add(self, stream: "SimStream", method: str, args: tuple, kwargs: dict, *, work: bool = True) -> None:
        if self.reason is not None:
            raise CaptureError(f"capture abandoned: {self.reason}")
        if stream not in self.work:
            self.lanes.append(stream)
            self.work[stream] = 0
        self.calls.append((self.lanes.index(stream), method, args, kwargs, None))
        if work:
            self.work[stream] += 1

    def record(self, stream: "SimStream", timing: bool) -> "CapturedEvent":
        if timing:
            raise self.abandon("a timing event cannot be captured; profile without a graph")
        self.add(stream, "record", (), {}, work=False)
        event = CapturedEvent(self, stream, self.work[stream])
        lane, method, args, kwargs, _ = self.calls[-1]
        self.calls[-1] = (lane, method, args, kwargs, event)
        return event

    def wait(self, stream: "SimStream", event: "CapturedEvent") -> None:
        self.add(stream, "wait", (event,), {})
        if event.stream is not stream:
            self.joined[event.stream] = max(self.joined.get(event.stream, 0), event.covers)

    def unjoined(self) -> list:
        return [s for s in self.lanes[1:] if self.work[s] > self.joined.get(s, 0)]


class CapturedEvent(Event):
    """An event recorded while capturing: a capturing stream may wait for it; nothing else may
    look at it (the work before it has not run and will run only when the graph is launched)."""

    timing = False

    def __init__(self, capture: SimCapture, stream: "SimStream", covers: int):
        self.capture = capture
        self.stream = stream
        self.covers = covers  # the stream's captured operations before it

    def __repr__(self) -> str:
        return f"<CapturedEvent on {self.stream.name}>"

    @property
    def owner(self) -> "SimDevice":
        return self.capture.dev

    def _refuse(self, what: str) -> CaptureError:
        if self.capture.ended:
            return CaptureError(f"{what} {self!r}: it belongs to a finished capture; use the graph's event() "
                                "for what a launch recorded")
        return self.capture.abandon(f"{what} {self!r}, recorded during the capture")

    @property
    def is_done(self) -> bool:
        raise self._refuse("querying")

    def sync(self) -> None:
        raise self._refuse("synchronising with")

    def elapsed_since(self, earlier: Event) -> float:
        raise self._refuse("timing")


class SimGraph(Graph):
    """A finished capture, replayed on lanes of its own by each :meth:`launch`."""

    def __init__(self, dev: "SimDevice", capture: SimCapture):
        self._dev = dev
        self._calls = capture.calls
        self._lanes = []
        try:
            for _ in capture.lanes:
                self._lanes.append(dev.create_stream())
        except BaseException:
            self.close()
            raise
        self._last: dict = {}  # captured event -> the event the last launch recorded in its place

    def __repr__(self) -> str:
        return f"<SimGraph of {len(self._calls)} calls on {len(self._lanes)} lanes{' closed' if self.closed else ''}>"

    @property
    def closed(self) -> bool:
        return not self._lanes

    def launch(self, stream) -> None:
        from .stream import SimStream

        if self.closed:
            raise RuntimeError(f"{self!r} is closed")
        if not isinstance(stream, SimStream) or stream._dev is not self._dev:
            raise ValueError(f"a graph launches on a stream of its own device, got {stream!r}")
        dev = self._dev
        with dev._lock:
            dev._host_api(dev.profile.launch_overhead_s)  # one launch for the whole graph
            with dev._host_calls_free():
                entry = stream.record()
                for lane in self._lanes:
                    lane.wait(entry)
                made: dict = {}
                try:
                    for index, method, args, kwargs, placeholder in self._calls:
                        if method == "wait":
                            args = (made[args[0]],)
                        result = getattr(self._lanes[index], method)(*args, **kwargs)
                        if placeholder is not None:
                            made[placeholder] = result
                    ends = [lane.record() for lane in self._lanes]
                    for end in ends:
                        stream.wait(end)
                except BaseException:
                    # stopped part way (an interrupt): a GPU's launch is all or nothing, so the
                    # launching stream must still come after the work already on the lanes, or
                    # syncing it, as a caller cleaning up does, would not cover that work
                    for lane in self._lanes:
                        stream.wait(lane.record())
                    raise
                stream._pass_on_errors(list(made.values()) + ends)
            self._last = made

    def event(self, captured: Event) -> "Event | None":
        return self._last.get(captured)

    def close(self) -> None:
        lanes, self._lanes = self._lanes, []
        self._last = {}
        for lane in lanes:
            try:
                lane.close()
            except Exception:  # noqa: BLE001 - closing never raises
                pass


def capturing_thread(dev: "SimDevice") -> Any:
    """The capture the calling thread has in progress on ``dev``, if any."""
    me = threading.get_ident()
    for capture in set(dev._captures.values()):
        if capture.thread == me:
            return capture
    return None
