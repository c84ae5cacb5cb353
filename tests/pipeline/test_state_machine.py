"""Invariants under chaos: a hypothesis state machine drives a pipeline on the chaotic sim.

Rules: submit items of random sizes (some marked to fail in prepare, compute or consume, or to
overflow a slot, or to make ``f`` write the wrong shape, or to call back into their own pipeline
from a stage), step the scheduler, wait on a
future, run a ``map`` and take its results a few at a time (or drop it), cancel, inject a
sticky device error, close. After every rule the harness checks (tests/helpers/pipeline_checks):

* only legal slot transitions (the rings raise IllegalTransition; the slot hook re-checks each
  one against LEGAL_SLOT_TRANSITIONS), and no slot is reused before its last owner's
  operations completed (or, for a device slot, without an event for the next owner to wait on);
* no HazardError (the sim's checker raises it from whatever call made the access; a hazard in
  a host task would surface as a StageError caused by it, which the checks reject);
* in-flight <= max_in_flight and ring occupancy <= ring size; free lists match slot states;
* accepted == delivered + failed + cancelled + in_flight, and per-chunk states agree;
* each delivered chunk's payload equals f(its own input) (payloads encode the item's tag, so
  data from another chunk or a poisoned slot never passes); ids unique; every failure is a
  StageError of the right stage, index and cause, reported once;
* map results in input order when ordered;
* after close: every slot FREE, nothing in flight, no live buffers, events or streams.
"""

from __future__ import annotations

import concurrent.futures

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import ringflow as rf
from ringflow._errors import DeviceError, StageError
from ringflow._pipeline.states import ChunkState, RingKind, SlotState
from tests.helpers.stateful import machine_settings
from tests.helpers.pipeline_checks import (
    FAULTS,
    REENTRIES,
    Harness,
    check_result,
    check_stage_error,
    future_outcome,
)

MAX_ELEMS = 32  # int64 elements: 256 bytes, the smallest slot used
SIZES = st.integers(0, MAX_ELEMS)
COSTS = st.sampled_from([0.0, 0.0, 0.0, 20e-6, 200e-6])
SLOTS = st.one_of(st.integers(1, 3), st.builds(rf.SlotCounts, st.integers(1, 2), st.integers(1, 2),
                                               st.integers(1, 2), st.integers(1, 2)))


class PipelineMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2 ** 16), slots=SLOTS, inplace=st.booleans(), ordered=st.booleans(),
                on_error=st.sampled_from(["raise", "continue"]), max_in_flight=st.one_of(st.none(), st.integers(1, 6)),
                workers=st.integers(1, 3), checked=st.booleans(), chunk_bytes=st.sampled_from([256, 512]))
    def setup(self, seed, slots, inplace, ordered, on_error, max_in_flight, workers, checked, chunk_bytes):
        if inplace:
            slots = slots if isinstance(slots, int) else rf.SlotCounts(slots.host_in, slots.device_in, 0, slots.host_out)
        self.h = Harness(seed=seed, chaos=True, slots=slots, inplace=inplace, ordered=ordered, on_error=on_error,
                         max_in_flight=max_in_flight, workers=workers, checked=checked, chunk_bytes=chunk_bytes)
        self.on_error = on_error
        self.ordered = ordered
        self.tag = 0
        self.futs: dict[int, tuple] = {}  # chunk index -> (future, item)
        self.map = None  # the active map: {"gen", "items", "pos", "taken", "started"}
        self.cancelled = self.closed = self.sticky = False
        self.user_cancelled: set[int] = set()  # chunks whose future the caller cancelled
        self.dropped: set[int] = set()  # tags of items a map took and was dropped before handing out

    # -- helpers -------------------------------------------------------------------------------
    @property
    def sched(self):
        return self.h.sched

    def new_item(self, n, fault=None, cost=0.0):
        self.tag += 1
        return self.h.item(self.tag, n, fault, consume_cost=cost)

    def stopped_by_error(self) -> bool:
        return self.on_error == "raise" and self.sched.first_error is not None

    def check_outcome(self, index, item, kind, value):
        if kind == "value":
            check_result(value, item, index)
        elif kind == "error" and isinstance(value, DeviceError) and value.sticky:
            assert self.sticky
        elif kind == "error":
            check_stage_error(value, item, index)
        else:
            assert self.cancelled or self.stopped_by_error() or index in self.user_cancelled \
                or item.tag in self.dropped, f"chunk {index} cancelled for no reason"

    # -- rules ---------------------------------------------------------------------------------
    def _submit(self, item):
        try:
            fut = self.h.pipe.submit(item)
        except RuntimeError as exc:
            if self.closed:
                assert "closed" in str(exc)
            else:
                assert "no longer accepts work" in str(exc)
                assert self.cancelled or self.stopped_by_error() or self.sticky
            return
        except DeviceError as exc:
            assert self.sticky and exc.sticky
            return
        assert not self.closed and not self.cancelled
        self.futs[fut.index] = (fut, item)

    @rule(n=SIZES, cost=COSTS)
    def submit(self, n, cost):
        self._submit(self.new_item(n, None, cost))

    @rule(sizes=st.lists(SIZES, min_size=1, max_size=10), cost=COSTS)
    def submit_many(self, sizes, cost):
        for n in sizes:
            self._submit(self.new_item(n, None, cost))

    @rule(n=SIZES, fault=st.sampled_from(FAULTS + REENTRIES), roll=st.integers(0, 2))
    def inject_fault(self, n, fault, roll):
        """Submit an item whose prepare, compute or consume raises (or overflows / writes badly,
        or calls back into its own pipeline);
        a third of the time, so that runs with on_error="raise" get somewhere first."""
        self._submit(self.new_item(max(n, 1), fault if roll == 1 else None))

    @precondition(lambda self: not self.sticky and not self.closed)
    @rule(roll=st.integers(0, 9))
    def inject_sticky_error(self, roll):
        if roll == 6:  # rarely (hypothesis favours 0): a sticky error ends the pipeline's useful life
            self.h.dev.inject_sticky_error()
            self.sticky = True

    @precondition(lambda self: not self.closed)
    @rule(k=st.integers(1, 25))
    def step(self, k):
        for _ in range(k):
            self.h.pipe._step()

    @precondition(lambda self: not self.closed and any(not f.done() for f, _ in self.futs.values()))
    @rule(data=st.data())
    def wait_future(self, data):
        index = data.draw(st.sampled_from(sorted(i for i, (f, _) in self.futs.items() if not f.done())))
        fut, item = self.futs[index]
        try:
            fut.result()
        except (StageError, DeviceError, concurrent.futures.CancelledError):
            pass
        assert fut.done()
        self.check_outcome(index, item, *future_outcome(fut))

    @precondition(lambda self: not self.closed and any(not f.done() for f, _ in self.futs.values()))
    @rule(data=st.data())
    def cancel_future(self, data):
        """The caller cancels one submitted chunk's future: the chunk stops (at once, or once its
        enqueued work completes), the others go on."""
        index = data.draw(st.sampled_from(sorted(i for i, (f, _) in self.futs.items() if not f.done())))
        fut, item = self.futs[index]
        chunk = self.h.chunks[index]
        # its consumer runs, or it is already ending (failing, or drained by a cancel)
        too_late = chunk.state in (ChunkState.CONSUMING, ChunkState.DRAINING)
        ok = fut.cancel()
        if ok:
            self.user_cancelled.add(index)
            assert fut.cancelled() and fut.done()
            assert chunk.state in (ChunkState.CANCELLED, ChunkState.DRAINING), chunk.state
        else:
            assert too_late or chunk.state.final, chunk.state

    @precondition(lambda self: self.map is None and not self.closed)
    @rule(sizes=st.lists(SIZES, min_size=0, max_size=16), faults=st.lists(st.sampled_from((None,) * 6 + FAULTS)),
          costs=st.lists(COSTS))
    def start_map(self, sizes, faults, costs):
        # varied consumer costs make consumers finish out of order (with more than one worker),
        # which an ordered map must hide
        items = [self.new_item(n, faults[k] if k < len(faults) else None, costs[k] if k < len(costs) else 0.0)
                 for k, n in enumerate(sizes)]
        self.map = {"gen": self.h.pipe.map(items), "items": items, "pos": 0, "taken": set(), "started": False,
                    "pos_of": {it.tag: k for k, it in enumerate(items)}, "stopped": self.cancelled}

    @precondition(lambda self: self.map is not None and not self.closed)
    @rule(k=st.integers(1, 6))
    def take_from_map(self, k):
        m = self.map
        for _ in range(k):
            started, m["started"] = m["started"], True
            try:
                value = next(m["gen"])
            except StopIteration:
                self._map_ended(m)
                return
            except StageError as err:
                assert self.on_error == "raise"
                assert err is self.sched.first_error or err.index in {c.index for c in self.h.chunks.values()
                                                                       if c.item in m["items"]}
                item = self.h.items[self.h.chunks[err.index].item.tag]
                check_stage_error(err, item, err.index)
                self.map = None
                return
            except DeviceError as err:
                assert self.sticky and err.sticky
                self.map = None
                return
            except RuntimeError as err:
                assert "no longer accepts work" in str(err) and not started
                assert self.cancelled or self.stopped_by_error()
                self.map = None
                return
            except concurrent.futures.CancelledError as err:
                # cut short by a cancel with input left or items pending: it says so, never ends quietly
                assert started and m["stopped"] and self.cancelled, str(err)
                assert f"map() was cut short after handing out {len(m['taken'])} result" in str(err), str(err)
                self.map = None
                return
            item = self.h.items.get(value.tag)
            assert item is not None and value.tag in m["pos_of"], f"map returned tag {value.tag} it was not given"
            assert value.tag not in m["taken"], f"map returned tag {value.tag} twice"
            check_result(value, item)
            pos = m["pos_of"][value.tag]
            if self.ordered:
                assert pos >= m["pos"], f"ordered map returned item {pos} after item {m['pos'] - 1}"
                skipped = m["items"][m["pos"]:pos]
                # only failed items may be skipped, and only when failures do not stop the map
                assert all(it.fault is not None for it in skipped) and (not skipped or self.on_error == "continue")
                m["pos"] = pos + 1
            m["taken"].add(value.tag)

    def _map_ended(self, m):
        self.map = None
        if self.stopped_by_error() or self.sticky:
            return  # a failure stopped the pipeline under it: a prefix (or a subset) is all it owes
        # a map a cancel cut short raises CancelledError (above): one that ended had handed out everything
        want = {it.tag for it in m["items"] if it.fault is None}
        assert m["taken"] == want, f"map ended with {sorted(want - m['taken'])} missing"

    @precondition(lambda self: self.map is not None)
    @rule()
    def drop_map(self):
        """The caller stops iterating early: what the map took and had not handed out is cancelled
        (a chunk whose consumer runs, or that had ended, ends as it would have)."""
        m = self.map
        self.dropped |= {it.tag for it in m["items"]} - m["taken"]
        m["gen"].close()
        self.map = None

    @rule(roll=st.integers(0, 2))
    def cancel(self, roll):
        if roll != 1:  # cancel and close end an example's interesting part: keep them rarer
            return
        self.h.pipe.cancel()
        if self.closed:
            return
        self.cancelled = True
        if self.map is not None:
            self.map["stopped"] = True
        s = self.h.pipe.stats()
        assert s.in_flight == 0 and s.balanced(), s
        for ring in self.sched.rings:
            assert all(slot.state is SlotState.FREE for slot in ring.slots), ring.slots
        for index, (fut, item) in self.futs.items():
            assert fut.done(), f"future {index} pending after cancel"
            self.check_outcome(index, item, *future_outcome(fut))

    @rule(roll=st.integers(0, 2))
    def close(self, roll):
        if roll != 1:
            return
        if self.closed:
            self.h.pipe.close()  # twice: harmless
            return
        self.h.pipe.close()
        assert self.h.pipe.stats().in_flight == 0
        for index, (fut, item) in self.futs.items():
            assert fut.done()
            self.check_outcome(index, item, *future_outcome(fut))
        if self.map is not None:  # results it had not handed out may still come; then it ends
            m, self.map = self.map, None
            m["stopped"] = True
            if m["started"]:
                try:
                    for value in m["gen"]:
                        check_result(value, self.h.items[value.tag])
                except StageError as err:  # a failure it had not raised yet
                    assert self.on_error == "raise"
                    check_stage_error(err, self.h.chunks[err.index].item, err.index)
                except DeviceError as err:
                    assert self.sticky and err.sticky
                except concurrent.futures.CancelledError as err:  # input left: cut short, saying so
                    assert "was cut short after handing out" in str(err), str(err)
            else:  # a map first iterated after close: like a submit after close
                try:
                    next(m["gen"])
                    raise AssertionError("a map started after close did not refuse")
                except RuntimeError as exc:
                    assert "closed" in str(exc)
        self.closed = True
        self._final_checks()

    def _final_checks(self):
        s = self.h.pipe.stats()
        for name, n in (("accepted", s.accepted), ("delivered", s.delivered), ("failed", s.failed),
                        ("cancelled", s.cancelled)):
            event(f"{name}: {'0' if n == 0 else '1-9' if n < 10 else '10+'}")
        event(f"ended by: {'sticky' if self.sticky else 'cancel' if self.cancelled else 'close'}")
        taken = sum(1 for kind, _, old, _new in self.h.transitions if kind is RingKind.HOST_IN and old is SlotState.FREE)
        wraps = taken // len(self.sched.host_in)
        event(f"host-in ring wrap-arounds: {'0' if wraps == 0 else '1-4' if wraps < 5 else '5+'}")
        self.futs = {}
        self.h.close()  # every slot FREE, nothing live (close again is harmless)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def harness_invariants(self):
        if not hasattr(self, "h"):
            return
        self.h.check()
        if self.h.final is not None:
            return
        # a failure is reported when it happens; its chunk ends FAILED once its fences complete
        failed_stage = {c.index for c in self.h.chunks.values() if isinstance(c.error, StageError) and
                        (c.state is ChunkState.FAILED or (c.state is ChunkState.DRAINING and
                                                          c.ending is ChunkState.FAILED))}
        reported = [e.index for e in self.h.pipe.failures]
        assert len(reported) == len(set(reported)), "a failure was reported twice"
        assert set(reported) == failed_stage, (reported, failed_stage)
        if any(c.state is ChunkState.CANCELLED and c.index not in self.user_cancelled and c.item.tag not in self.dropped
               for c in self.h.chunks.values()):
            assert self.cancelled or self.stopped_by_error(), "chunks cancelled without a cancel or an error"

    def teardown(self):
        if not hasattr(self, "h"):
            return
        if not self.closed:
            if self.map is not None:
                self.map["gen"].close()
                self.map = None
            self.h.pipe.close()
            self.closed = True
            self._final_checks()


# hundreds of examples in the default run (derandomized, so CI is repeatable); a soak run:
# tests/helpers/stateful.py
PipelineMachine.TestCase.settings = machine_settings(400, 50, derandomize=True)
test_pipeline_state_machine = PipelineMachine.TestCase
