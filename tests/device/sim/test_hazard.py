"""The happens-before checker on its own, with synthetic actor and buffer ids.

Mirrors the cases of PyTorch's CUDA sanitizer tests (test/test_cuda_sanitizer.py,
TestEventHandler) and adds releases, byte ranges, host threads and the error message; a
hypothesis test compares the checker against a brute-force happens-before oracle.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringflow import HazardError
from ringflow._device.sim import hazard
from ringflow._device.sim.hazard import Access, AccessKind, HappensBeforeChecker

R, W, REL = AccessKind.READ, AccessKind.WRITE, AccessKind.RELEASE
SIZE = 100  # bytes of every synthetic buffer


def stream(i: int) -> tuple:
    return ("stream", i)


class Harness:
    """The sanitizer's vocabulary on top of the checker: kernel launches, event record / wait."""

    def __init__(self) -> None:
        self.c = HappensBeforeChecker()
        self.events: dict = {}

    def actor(self, a) -> None:
        self.c.add_actor(a, f"{a[0]} {a[1]}" if isinstance(a, tuple) else str(a))

    def launch(self, s: int, read_only=(), read_write=(), ranges=None, op="kernel") -> None:
        """One operation on stream ``s``: one tick, one access per buffer (as the sim does)."""
        a = stream(s)
        self.actor(a)
        self.c.tick(a)
        ranges = ranges or {}
        for b in read_only:
            lo, hi = ranges.get(b, (0, SIZE))
            self.c.access(a, R, b, f"buffer {b}", lo, hi, op, tick=False)
        for b in read_write:
            lo, hi = ranges.get(b, (0, SIZE))
            self.c.access(a, R, b, f"buffer {b}", lo, hi, op, tick=False)
            self.c.access(a, W, b, f"buffer {b}", lo, hi, op, tick=False)

    def good(self, s: int, read_only=(), read_write=(), **kw) -> None:
        self.launch(s, read_only, read_write, **kw)

    def bad(self, s: int, read_only=(), read_write=(), **kw) -> HazardError:
        with pytest.raises(HazardError) as info:
            self.launch(s, read_only, read_write, **kw)
        return info.value

    def record(self, e: int, s: int) -> None:
        self.actor(stream(s))
        self.c.tick(stream(s))
        self.events[e] = self.c.snapshot(stream(s))

    def wait(self, e: int, s: int) -> None:
        self.actor(stream(s))
        self.c.merge(stream(s), self.events.get(e, {}))  # a never-recorded event carries nothing


@pytest.fixture
def h() -> Harness:
    return Harness()


# -- the sanitizer's cases ----------------------------------------------------------------------
def test_empty_kernel_launch(h):
    h.good(0)


def test_read_after_read_on_two_streams_is_fine(h):
    h.good(1, read_only=[1])
    h.good(2, read_only=[1])


def test_write_after_read_unsynchronised(h):
    h.good(1, read_only=[1])
    h.bad(2, read_write=[1])


def test_read_after_write_unsynchronised(h):
    h.good(1, read_write=[1])
    h.bad(2, read_only=[1])


def test_write_after_write_unsynchronised(h):
    h.good(1, read_write=[1])
    h.bad(2, read_write=[1])


@pytest.mark.parametrize("first,second", [("r", "w"), ("w", "r"), ("w", "w")])
def test_record_then_wait_orders_each_conflict(h, first, second):
    h.good(1, **({"read_only": [1]} if first == "r" else {"read_write": [1]}))
    h.record(0, 1)
    h.wait(0, 2)
    h.good(2, **({"read_only": [1]} if second == "r" else {"read_write": [1]}))


def test_same_stream_is_program_ordered(h):
    h.good(1, read_write=[1])
    h.good(1, read_only=[1])
    h.good(1, read_write=[1])


def test_reads_check_last_write(h):
    # not only the first read after a write is checked against it: every later one is
    h.good(1, read_write=[1])
    h.record(0, 1)
    h.wait(0, 2)
    h.good(2, read_only=[1])
    h.bad(3, read_only=[1])


def _two_readers_after_one_writer(h, event: int) -> None:
    """Stream 1 writes buffer 1 and records ``event``; streams 2 and 3 both wait on it, then read."""
    h.good(1, read_write=[1])
    h.record(event, 1)
    h.wait(event, 2)
    h.wait(event, 3)
    h.good(2, read_only=[1])
    h.good(3, read_only=[1])


def test_branch_sync(h):
    # two streams may read after both wait for a third, but neither may then write
    _two_readers_after_one_writer(h, event=0)
    h.bad(2, read_write=[1])


def test_chain_sync_through_ten_streams(h):
    h.good(0, read_only=[1])
    for i in range(10):
        h.record(i, i)
        h.wait(i, i + 1)
    h.good(10, read_write=[1])


def test_chain_with_one_link_missing_is_caught(h):
    h.good(0, read_only=[1])
    for i in range(10):
        if i != 6:
            h.record(i, i)
            h.wait(i, i + 1)
    h.bad(10, read_write=[1])


def test_expired_record(h):
    # the event was recorded before the access it was meant to order
    h.good(1, read_only=[1])
    h.record(0, 1)
    h.good(1, read_only=[1])
    h.wait(0, 2)
    h.bad(2, read_write=[1])


def test_expired_record_of_a_write(h):
    h.record(0, 1)
    h.good(1, read_write=[1])
    h.wait(0, 2)
    h.bad(2, read_only=[1])


def test_wait_on_a_never_recorded_event_orders_nothing(h):
    # the sanitizer's "deleted record": an event with no record carries no ordering
    h.good(1, read_only=[1])
    h.wait(99, 2)
    h.bad(2, read_write=[1])


def test_all_reads_checked_failing(h):
    for i in range(1, 11):
        h.good(i, read_only=[1])
        h.record(i, i)
    for i in range(1, 10):  # stream 10's read is not waited for
        h.wait(i, 0)
    err = h.bad(0, read_write=[1])
    assert err.first.actor == stream(10)


def test_all_reads_checked_passing(h):
    for i in range(1, 10):
        h.good(i, read_only=[1])
        h.record(i, i)
    for i in range(1, 10):
        h.wait(i, 0)
    h.good(0, read_write=[1])


def test_correct_state_merging(h):
    # after a wait a stream's clock is the pointwise max of its own and the event's
    h.good(1, read_write=[1])
    h.good(2, read_write=[2])
    h.record(1, 1)
    h.record(2, 2)
    h.good(1, read_write=[1])
    h.good(2, read_write=[2])
    h.wait(1, 2)
    h.wait(2, 1)
    h.record(3, 2)
    h.wait(3, 1)
    h.good(1, read_write=[1, 2])


def test_record_override(h):
    # re-recording an event replaces what it carries
    h.good(1, read_only=[1])
    h.good(2, read_only=[2])
    h.record(1, 1)
    h.record(1, 2)
    h.wait(1, 3)
    h.bad(3, read_write=[1])


def test_multiple_wait(h):
    _two_readers_after_one_writer(h, event=1)


def _diamond_sides(h) -> None:
    """Stream 0 writes buffer 1; streams 1 and 2 each wait on it, then rewrite one half of it."""
    h.good(0, read_write=[1])
    h.record(0, 0)
    h.wait(0, 1)
    h.wait(0, 2)
    h.good(1, read_write=[1], ranges={1: (0, 50)})
    h.good(2, read_write=[1], ranges={1: (50, 100)})


def test_diamond(h):
    # 0 writes; 1 and 2 each fix up half after waiting on 0; 3 reads all after waiting on both
    _diamond_sides(h)
    h.record(1, 1)
    h.record(2, 2)
    h.wait(1, 3)
    h.wait(2, 3)
    h.good(3, read_write=[1])


def test_diamond_missing_one_side(h):
    _diamond_sides(h)
    h.record(1, 1)
    h.wait(1, 3)  # and not on stream 2's half
    err = h.bad(3, read_only=[1])
    assert err.first.actor == stream(2) and (err.first.start, err.first.end) == (50, 100)


def test_transitive_order_through_an_intermediate_stream(h):
    # 1 writes; 2 waits on 1 (touching nothing); 3 waits on 2: 3 is ordered after 1
    h.good(1, read_write=[1])
    h.record(1, 1)
    h.wait(1, 2)
    h.record(2, 2)
    h.wait(2, 3)
    h.good(3, read_write=[1])


# -- byte ranges ---------------------------------------------------------------------------------
def test_disjoint_ranges_do_not_conflict(h):
    h.good(1, read_write=[1], ranges={1: (0, 50)})
    h.good(2, read_write=[1], ranges={1: (50, 100)})


def test_partial_overlap_conflicts(h):
    h.good(1, read_write=[1], ranges={1: (0, 51)})
    err = h.bad(2, read_only=[1], ranges={1: (50, 100)})
    assert (err.first.start, err.first.end, err.second.start, err.second.end) == (0, 51, 50, 100)


def test_different_buffers_do_not_conflict(h):
    h.good(1, read_write=[1])
    h.good(2, read_write=[2])


def test_empty_range_touches_nothing(h):
    h.good(1, read_write=[1])
    h.good(2, read_write=[1], ranges={1: (10, 10)})


def test_a_covering_write_keeps_older_conflicts_visible(h):
    # stream 2's write of [0,100) is ordered after stream 1's read of [0,50) and supersedes it;
    # stream 3 must still be caught (now against stream 2's write)
    h.good(1, read_only=[1], ranges={1: (0, 50)})
    h.record(1, 1)
    h.wait(1, 2)
    h.good(2, read_write=[1])
    err = h.bad(3, read_only=[1], ranges={1: (0, 10)})
    assert err.first.actor == stream(2)


def test_a_write_covering_only_part_of_an_older_one_keeps_the_rest_visible(h):
    h.good(1, read_write=[1], ranges={1: (0, 60)})
    h.record(1, 1)
    h.wait(1, 2)
    h.good(2, read_write=[1], ranges={1: (50, 100)})  # ordered after stream 1, covers only [50, 100)
    err = h.bad(3, read_only=[1], ranges={1: (0, 10)})
    assert err.first.actor == stream(1) and (err.first.start, err.first.end) == (0, 60)


def test_merge_takes_the_pointwise_maximum():
    from ringflow._device.sim.hazard import merge_into

    target = {"a": 3, "b": 1}
    merge_into(target, {"a": 2, "b": 2, "c": 5})
    assert target == {"a": 3, "b": 2, "c": 5}


def test_reads_of_other_streams_are_not_superseded(h):
    h.good(1, read_only=[1])
    h.good(2, read_only=[1])  # a second reader does not hide the first
    h.record(2, 2)
    h.wait(2, 3)
    err = h.bad(3, read_write=[1])
    assert err.first.actor == stream(1)


# -- releases ----------------------------------------------------------------------------------
def test_release_conflicts_with_an_unordered_read(h):
    h.good(1, read_only=[1])
    h.actor("host")
    with pytest.raises(HazardError, match="release"):
        h.c.access("host", REL, 1, "buffer 1", 0, SIZE, "free")


def test_release_conflicts_with_earlier_accesses_that_were_superseded_in_range(h):
    # the release covers everything, even ranges no single access covered
    h.good(1, read_only=[1], ranges={1: (90, 100)})
    h.actor("host")
    with pytest.raises(HazardError):
        h.c.access("host", REL, 1, "buffer 1", 0, SIZE, "free")


def test_release_after_sync_is_fine_and_forgets_history(h):
    h.good(1, read_write=[1])
    h.record(1, 1)
    h.actor("host")
    h.c.merge("host", h.events[1])
    h.c.access("host", REL, 1, "buffer 1", 0, SIZE, "free")
    assert h.c.live_buffers() == 0
    h.good(2, read_write=[1])  # a new buffer under the same id starts clean


def test_stream_ordered_release_on_the_reading_stream(h):
    h.good(1, read_only=[1])
    h.c.access(stream(1), REL, 1, "buffer 1", 0, SIZE, "free on stream 1")


def test_stream_ordered_release_on_another_stream_needs_a_wait(h):
    h.good(1, read_only=[1])
    h.actor(stream(2))
    with pytest.raises(HazardError):
        h.c.access(stream(2), REL, 1, "buffer 1", 0, SIZE, "free on stream 2")


# -- host actors ---------------------------------------------------------------------------------
def test_host_sync_merges_like_a_wait(h):
    h.good(1, read_write=[1])
    h.record(1, 1)
    h.actor("host")
    with pytest.raises(HazardError):
        h.c.access("host", R, 1, "buffer 1", 0, SIZE, "host read")
    h.c.merge("host", h.events[1])
    h.c.access("host", R, 1, "buffer 1", 0, SIZE, "host read")


def test_restart_forgets_what_the_actor_learned_before(h):
    """A pool task restarts its actor from the submitter's clock: an order the actor's previous
    program learned (here: stream 0's write) does not carry over to the next program."""
    task = ("task", 0)
    h.actor(task)
    h.good(0, read_write=[1])
    h.record(1, 0)
    h.c.merge(task, h.events[1])  # program 1 of the task waited for stream 0's write
    h.c.access(task, R, 1, "buffer 1", 0, SIZE, "host view")
    # program 2 starts from a clock that has seen program 1's last operation and nothing else
    h.c.restart(task, {task: h.c.snapshot(task)[task]})
    with pytest.raises(HazardError):
        h.c.access(task, W, 1, "buffer 1", 0, SIZE, "host view")  # stream 0's write is not ordered before


def test_restart_from_a_clock_that_missed_the_actors_last_operation_is_refused():
    c = HappensBeforeChecker()
    c.add_actor("task", "task")
    c.add_actor("host", "host")
    c.tick("task")
    assert not c.has_seen(c.snapshot("host"), "task")
    with pytest.raises(ValueError, match="has not seen its last operation"):
        c.restart("task", c.snapshot("host"))
    c.merge("host", c.snapshot("task"))
    assert c.has_seen(c.snapshot("host"), "task")
    c.restart("task", c.snapshot("host"))
    assert c.tick("task") == 2  # the numbering continues


def test_unknown_actor_is_refused():
    c = HappensBeforeChecker()
    with pytest.raises(KeyError, match="add_actor"):
        c.access("nobody", R, 1, "b", 0, 1, "read")


# -- the error -----------------------------------------------------------------------------------
def test_hazard_error_names_both_accesses():
    c = HappensBeforeChecker()
    c.add_actor(stream(1), "stream 1")
    c.add_actor(stream(2), "stream 2")
    c.access(stream(1), W, "b7", "device buffer #7", 16, 48, "copy h2d 32 B")
    with pytest.raises(HazardError) as info:
        c.access(stream(2), R, "b7", "device buffer #7", 0, 32, "launch scale")
    err, msg = info.value, str(info.value)
    for part in ("copy h2d 32 B", "launch scale", "stream 1", "stream 2", "device buffer #7", "[16, 48)", "[0, 32)",
                 "write", "read"):
        assert part in msg, (part, msg)
    assert "wait" in msg  # says what to change
    assert isinstance(err.first, Access) and isinstance(err.second, Access)
    assert (err.first.op, err.first.kind, err.first.actor) == ("copy h2d 32 B", W, stream(1))
    assert (err.second.op, err.second.kind, err.second.actor) == ("launch scale", R, stream(2))


def test_checked_counts_every_access(h):
    before = h.c.checked
    h.good(1, read_only=[1, 2], read_write=[3])
    assert h.c.checked - before == 4  # two reads, then a read and a write of buffer 3


# -- differential test against a brute-force oracle -----------------------------------------------
# The oracle keeps, per actor, the set of every operation that happened before its current point
# (no vector clocks, no pruning); an access is a hazard iff some earlier conflicting access of
# the same buffer is not in that set. The checker must raise at exactly the first such access.

ACTORS = [stream(0), stream(1), stream(2), "host"]
BUFS = [1, 1, 1, 2]  # mostly one buffer, so conflicts are common
rng_st = st.tuples(st.integers(0, 3), st.integers(1, 3)).map(lambda t: (t[0] * 8, min(32, t[0] * 8 + t[1] * 8)))
step_st = st.one_of(
    st.tuples(st.just("access"), st.sampled_from(ACTORS), st.sampled_from([R, W]), st.sampled_from(BUFS), rng_st),
    st.tuples(st.just("launch"), st.sampled_from(ACTORS[:3]), st.sampled_from(BUFS), rng_st, st.sampled_from(BUFS),
              rng_st),
    st.tuples(st.just("record"), st.sampled_from(ACTORS)),
    st.tuples(st.just("wait"), st.sampled_from(ACTORS), st.integers(0, 50)),
    st.tuples(st.just("wait"), st.sampled_from(ACTORS), st.integers(0, 50)),  # twice: waits are common
    st.tuples(st.just("release"), st.sampled_from(ACTORS), st.sampled_from(BUFS)),
)


class Oracle:
    def __init__(self) -> None:
        self.known = {a: set() for a in ACTORS}
        self.history: dict = {b: [] for b in BUFS}  # (op_id, actor, kind, lo, hi)
        self.next_id = 0

    def op(self, actor) -> int:
        self.next_id += 1
        return self.next_id

    def hazard(self, op_id, actor, kind, buf, lo, hi) -> bool:
        for (pid, pactor, pkind, plo, phi) in self.history[buf]:
            if pid == op_id or pid in self.known[actor]:
                continue
            if plo < hi and lo < phi and (pkind is not R or kind is not R):
                return True
        return False

    def add(self, op_id, actor, kind, buf, lo, hi) -> None:
        self.history[buf].append((op_id, actor, kind, lo, hi))

    def done(self, op_id, actor) -> None:
        self.known[actor].add(op_id)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step_st, min_size=1, max_size=40))
def test_checker_matches_brute_force_oracle(steps):
    check_against_oracle(steps)


# a stream closed and another made in its place (a new actor that knows nothing), with a sweep of
# retired actors at every new one: forgetting them must change no verdict
renew_st = st.tuples(st.just("renew"), st.sampled_from(ACTORS[:3]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(step_st, renew_st, renew_st), min_size=1, max_size=50))
def test_checker_with_retired_actors_matches_brute_force_oracle(steps):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hazard, "SWEEP_MIN", 1)
        check_against_oracle(steps)


def check_against_oracle(steps) -> None:
    c = HappensBeforeChecker()
    for a in ACTORS:
        c.add_actor(a, str(a))
    o = Oracle()
    events: list = []  # (vector clock snapshot, oracle known set)
    current = {a: a for a in ACTORS}  # each slot's actor now (a renewed slot has a new one)
    renewals = 0
    for step in steps:
        kind = step[0]
        if kind == "renew":
            slot = step[1]
            c.retire(current[slot])
            renewals += 1
            current[slot] = (slot, renewals)
            c.add_actor(current[slot], str(current[slot]))
            o.known[slot] = set()
            continue
        if kind in ("access", "launch", "release"):
            if kind == "access":
                _, actor, k, buf, (lo, hi) = step
                accesses = [(k, buf, lo, hi)]
            elif kind == "launch":
                _, actor, b1, (lo1, hi1), b2, (lo2, hi2) = step
                accesses = [(R, b1, lo1, hi1), (W, b2, lo2, hi2)]
            else:
                _, actor, buf = step
                accesses = [(REL, buf, 0, SIZE)]
            who = current[actor]  # the checker's actor; the oracle knows the slot
            op_id = o.op(actor)
            expect = False
            for (k, buf, lo, hi) in accesses:
                if o.hazard(op_id, actor, k, buf, lo, hi):
                    expect = True
                    break
                o.add(op_id, actor, k, buf, lo, hi)
            c.tick(who)
            if expect:
                with pytest.raises(HazardError) as info:
                    for (k, buf, lo, hi) in accesses:
                        c.access(who, k, buf, str(buf), lo, hi, kind, tick=False)
                err = info.value
                # the pair it names really is unordered and conflicting
                assert err.second.actor == who and err.first.actor != who
                assert err.first.overlaps(err.second)
                assert err.first.kind.writes or err.second.kind.writes
                return
            for (k, buf, lo, hi) in accesses:
                c.access(who, k, buf, str(buf), lo, hi, kind, tick=False)
            o.done(op_id, actor)
            if kind == "release":
                o.history[accesses[0][1]] = []
        elif kind == "record":
            _, actor = step
            c.tick(current[actor])
            op_id = o.op(actor)
            o.done(op_id, actor)
            events.append((c.snapshot(current[actor]), frozenset(o.known[actor])))
        else:
            _, actor, idx = step
            if not events:
                continue
            snap, known = events[idx % len(events)]
            c.merge(current[actor], snap)
            o.known[actor] |= known


# -- retired actors ------------------------------------------------------------------------------
def test_retired_actors_leave_every_clock_once_no_kept_access_is_theirs():
    # a long-lived device sees actors come and go (each pipeline's streams, pools and threads):
    # the clocks must hold the actors alive now, not every actor there ever was
    c = HappensBeforeChecker()
    c.add_actor("host", "host")
    for i in range(2000):
        s = stream(i)
        c.add_actor(s, f"stream {i}")
        c.merge(s, c.snapshot("host"))
        c.access(s, W, f"b{i}", f"buffer {i}", 0, SIZE, "copy")
        c.merge("host", c.snapshot(s))  # the host syncs the stream
        c.access("host", REL, f"b{i}", f"buffer {i}", 0, SIZE, "free")
        c.retire(s)
    actors, entries = c.size()
    assert actors < 200 and entries < 200 * 8, (actors, entries)


def test_a_retired_actors_kept_access_still_conflicts():
    # the write of a stream closed since is still in the buffer's history: an unordered read
    # must still be caught, however many actors come and go before it
    c = HappensBeforeChecker()
    c.add_actor(stream(0), "stream 0")
    c.access(stream(0), W, "b", "buffer b", 0, SIZE, "copy h2d")
    c.retire(stream(0))
    for i in range(1, 500):
        c.add_actor(stream(i), f"stream {i}")
        c.retire(stream(i))
    c.add_actor(stream(500), "stream 500")
    with pytest.raises(HazardError, match="copy h2d"):
        c.access(stream(500), R, "b", "buffer b", 0, SIZE, "launch")
    assert stream(0) not in c._clocks  # its own clock went; the others still know of its write


def test_a_retired_actors_kept_access_stays_ordered_for_those_that_saw_it():
    c = HappensBeforeChecker()
    c.add_actor(stream(0), "stream 0")
    c.access(stream(0), W, "b", "buffer b", 0, SIZE, "copy h2d")
    c.add_actor(stream(1), "stream 1")
    c.merge(stream(1), c.snapshot(stream(0)))  # stream 1 waited on stream 0's event
    c.retire(stream(0))
    for i in range(2, 500):
        c.add_actor(stream(i), f"stream {i}")
        c.retire(stream(i))
    c.access(stream(1), R, "b", "buffer b", 0, SIZE, "launch")  # ordered: no error


def test_an_event_of_a_retired_actor_still_orders_its_kept_access():
    # stream 0 writes, records an event and is closed; the event is waited on only after its
    # clock has been swept: the wait must still order stream 0's kept write
    c = HappensBeforeChecker()
    c.add_actor(stream(0), "stream 0")
    c.tick(stream(0))
    c.access(stream(0), W, "b", "buffer b", 0, SIZE, "copy h2d", tick=False)
    event = c.snapshot(stream(0))
    c.retire(stream(0))
    for i in range(1, 500):
        c.add_actor(stream(i), f"stream {i}")
        c.retire(stream(i))
    c.add_actor(stream(500), "stream 500")
    c.merge(stream(500), event)
    c.access(stream(500), R, "b", "buffer b", 0, SIZE, "launch")  # ordered: no error
