"""The connection slot policy on its own: bounded slots, eviction of the longest-waiting, a
reserve that fills only when every regular connection is busy."""

from __future__ import annotations

import pytest

from servewell.api.connection_slots import ConnectionSlots, SlotKind


class Connection:
    """A connection as the slots see it: it can be told to close."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True

    def __repr__(self) -> str:
        return self.name


def admitted(slots: ConnectionSlots, *names: str) -> list[Connection]:
    connections = [Connection(n) for n in names]
    for connection in connections:
        assert slots.admit(connection) is SlotKind.REGULAR
    return connections


def test_admits_up_to_the_limit_then_evicts_the_longest_waiting():
    slots = ConnectionSlots(regular=3, reserve=1)
    a, b, c = admitted(slots, "a", "b", "c")
    d = Connection("d")
    assert slots.admit(d) is SlotKind.REGULAR
    assert (a.evicted, b.evicted, c.evicted) == (True, False, False)
    assert slots.open == 3 and slots.evicted == 1


def test_a_connection_that_finished_a_request_waits_from_then_on():
    slots = ConnectionSlots(regular=2, reserve=0)
    a, b = admitted(slots, "a", "b")
    slots.busy(a)
    slots.waiting(a)  # a answered its request: now it has waited less than b
    assert slots.admit(Connection("c")) is SlotKind.REGULAR
    assert (a.evicted, b.evicted) == (False, True)


def test_busy_connections_are_never_evicted_and_newcomers_get_the_reserve():
    slots = ConnectionSlots(regular=2, reserve=2)
    for connection in admitted(slots, "a", "b"):
        slots.busy(connection)
    r1, r2 = Connection("r1"), Connection("r2")
    assert slots.admit(r1) is SlotKind.RESERVE and slots.admit(r2) is SlotKind.RESERVE
    assert slots.reserve_in_use == 2
    r3 = Connection("r3")
    assert slots.admit(r3) is SlotKind.RESERVE and r1.evicted  # a waiting reserve connection makes room
    for connection in (r2, r3):
        slots.busy(connection)
    assert slots.admit(Connection("x")) is SlotKind.REFUSED
    assert slots.refused == 1 and slots.open == 4


def test_a_released_slot_is_free_again_and_release_is_idempotent():
    slots = ConnectionSlots(regular=1, reserve=0)
    (a,) = admitted(slots, "a")
    slots.busy(a)
    assert slots.admit(Connection("b")) is SlotKind.REFUSED
    slots.release(a)
    slots.release(a)
    c = Connection("c")
    assert slots.admit(c) is SlotKind.REGULAR
    slots.release(a)  # a late close of an old connection frees nobody else's slot
    slots.busy(c)
    assert slots.admit(Connection("d")) is SlotKind.REFUSED


def test_an_evicted_connection_closing_later_does_not_free_a_second_slot():
    slots = ConnectionSlots(regular=1, reserve=0)
    (a,) = admitted(slots, "a")
    b = Connection("b")
    assert slots.admit(b) is SlotKind.REGULAR and a.evicted
    slots.release(a)  # its connection_lost arrives after the eviction
    slots.busy(b)
    assert slots.open == 1 and slots.admit(Connection("c")) is SlotKind.REFUSED


def test_a_slot_policy_needs_a_regular_slot():
    with pytest.raises(ValueError):
        ConnectionSlots(regular=0, reserve=4)
