"""The ownership tables: each ring kind's path, DRAINING from every busy state, nothing else."""

import itertools

import pytest

from ringflow._pipeline.states import (
    LEGAL_CHUNK_TRANSITIONS,
    LEGAL_SLOT_TRANSITIONS,
    ChunkState,
    IllegalTransition,
    RingKind,
    SlotState,
    check_chunk_transition,
)

S, C = SlotState, ChunkState

PATHS = {
    RingKind.HOST_IN: [S.FREE, S.FILLING, S.FILLED, S.COPYING_IN, S.FREE],
    RingKind.DEVICE_IN: [S.FREE, S.COPYING_IN, S.COMPUTING, S.FREE],
    RingKind.DEVICE_OUT: [S.FREE, S.COMPUTING, S.COPYING_OUT, S.FREE],
    RingKind.HOST_OUT: [S.FREE, S.COPYING_OUT, S.CONSUMING, S.FREE],
    RingKind.DEVICE_INPLACE: [S.FREE, S.COPYING_IN, S.COMPUTING, S.COPYING_OUT, S.FREE],
}


# the rings the compute writes may lend a slot to the consumer (results delivered on the device)
LENDS = {RingKind.DEVICE_OUT, RingKind.DEVICE_INPLACE}


def expected_table(path, lends=False):
    edges = set(zip(path, path[1:]))
    if lends:
        edges |= {(S.COMPUTING, S.LENT), (S.LENT, S.FREE)}
    busy = set(path) - {S.FREE} | ({S.LENT} if lends else set())
    return edges | {(b, S.DRAINING) for b in busy} | {(S.DRAINING, S.FREE)}


@pytest.mark.parametrize("kind", list(RingKind))
def test_each_ring_has_exactly_its_path_plus_draining(kind):
    assert LEGAL_SLOT_TRANSITIONS[kind] == expected_table(PATHS[kind], kind in LENDS)


@pytest.mark.parametrize("kind", list(RingKind))
def test_no_shortcuts(kind):
    table = LEGAL_SLOT_TRANSITIONS[kind]
    # a free slot can only be taken into the first state of its path, never drained or freed again
    assert {new for old, new in table if old is S.FREE} == {PATHS[kind][1]}
    assert (S.FREE, S.DRAINING) not in table and (S.FREE, S.FREE) not in table
    # the only way back to FREE is from the state whose completion ends the lifetime, or DRAINING
    assert {old for old, new in table if new is S.FREE} == {PATHS[kind][-2], S.DRAINING} | (
        {S.LENT} if kind in LENDS else set())
    # DRAINING leads only to FREE
    assert {new for old, new in table if old is S.DRAINING} == {S.FREE}
    # no self loops
    assert all(old is not new for old, new in table)


def test_lifetimes_end_where_design_says():
    # host-in free once its H2D completes; device-in once compute completes; device-out once its
    # D2H completes; host-out once the consumer returns (docs/design.md, "Slot lifetimes")
    assert (S.COPYING_IN, S.FREE) in LEGAL_SLOT_TRANSITIONS[RingKind.HOST_IN]
    assert (S.COMPUTING, S.FREE) in LEGAL_SLOT_TRANSITIONS[RingKind.DEVICE_IN]
    assert (S.COPYING_OUT, S.FREE) in LEGAL_SLOT_TRANSITIONS[RingKind.DEVICE_OUT]
    assert (S.CONSUMING, S.FREE) in LEGAL_SLOT_TRANSITIONS[RingKind.HOST_OUT]
    assert (S.COMPUTING, S.FREE) not in LEGAL_SLOT_TRANSITIONS[RingKind.DEVICE_INPLACE]


def test_chunk_path_and_endings():
    path = [C.ACCEPTED, C.PREPARING, C.PREPARED, C.ON_DEVICE, C.CONSUMING, C.DELIVERED]
    for old, new in zip(path, path[1:]):
        check_chunk_transition(0, old, new)
    for state in path[:-1]:
        for end in (C.DRAINING, C.FAILED, C.CANCELLED):
            check_chunk_transition(0, state, end)
    check_chunk_transition(0, C.DRAINING, C.FAILED)
    check_chunk_transition(0, C.DRAINING, C.CANCELLED)


@pytest.mark.parametrize("old,new", [(a, b) for a, b in itertools.product(ChunkState, repeat=2)
                                     if (a, b) not in LEGAL_CHUNK_TRANSITIONS])
def test_illegal_chunk_transitions_raise(old, new):
    with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
        check_chunk_transition(7, old, new)


def test_final_states_are_terminal():
    finals = {s for s in ChunkState if s.final}
    assert finals == {C.DELIVERED, C.FAILED, C.CANCELLED}
    assert not any(old in finals for old, _ in LEGAL_CHUNK_TRANSITIONS)
    assert (C.DRAINING, C.DELIVERED) not in LEGAL_CHUNK_TRANSITIONS  # a drained chunk never delivers


def test_illegal_transition_is_an_assertion_error():
    # a scheduler bug, never a user error: it must not be swallowed as an ordinary Exception
    # by error handling meant for user code
    assert issubclass(IllegalTransition, AssertionError)
