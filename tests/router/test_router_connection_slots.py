"""ConnectionSlots (router/http/connection_slots.py): which connection is served, which gives up its
slot, which is refused, exactly."""
from __future__ import annotations

from router.http.connection_slots import Admission, ConnectionSlots


class Conn:
    def __init__(self, name: str, evicted: list[str]):
        self.name, self._evicted = name, evicted
        self.unsent = 0

    def sending(self) -> bool:
        return self.unsent > 0

    def evict(self) -> None:
        self._evicted.append(self.name)


def test_at_the_cap_the_connection_waiting_longest_for_its_request_gives_up_its_slot():
    """a waits, b runs its request, c waits (after a), d waits: a new connection evicts a, the
    next c (b's slot is safe), and a keep-alive connection waits again from the back of the line."""
    evicted: list[str] = []
    slots = ConnectionSlots(max_connections=3, max_refusals=1)
    a, b, c, d, e = (Conn(n, evicted) for n in "abcde")
    for conn in (a, b, c):
        assert slots.admit(conn) is Admission.SERVE
        slots.waiting(conn)
    slots.running(b)
    assert slots.admit(d) is Admission.SERVE and evicted == ["a"]
    slots.waiting(d)
    slots.left(a)                               # its connection_lost, after the eviction
    slots.waiting(b)                            # b's response done: it waits for the next request
    assert slots.admit(e) is Admission.SERVE and evicted == ["a", "c"]
    slots.waiting(e)
    assert slots.admit(Conn("f", evicted)) is Admission.SERVE and evicted == ["a", "c", "d"]


def test_when_every_slot_runs_a_request_new_ones_are_refused_then_dropped():
    """No connection waits: max_refusals get a 503, the next are closed unanswered; a refusal that
    ends frees its place, and a connection that leaves frees its slot."""
    evicted: list[str] = []
    slots = ConnectionSlots(max_connections=2, max_refusals=2)
    served = [Conn(n, evicted) for n in "ab"]
    for conn in served:
        assert slots.admit(conn) is Admission.SERVE
        slots.running(conn)
    refused = [Conn(n, evicted) for n in "cd"]
    assert [slots.admit(c) for c in refused] == [Admission.REFUSE] * 2
    assert slots.admit(Conn("e", evicted)) is Admission.DROP
    slots.left(refused[0])
    assert slots.admit(Conn("f", evicted)) is Admission.REFUSE
    slots.left(served[0])
    assert slots.admit(Conn("g", evicted)) is Admission.SERVE and evicted == []


def test_a_connection_still_sending_its_request_or_receiving_a_response_goes_last():
    """a, b, c wait; a then sends a byte of its body (waiting again moves it to the back), and b's
    last response is still going out: a new connection evicts c, the next a, never b while its
    response is unsent; once sent, b is evicted."""
    evicted: list[str] = []
    slots = ConnectionSlots(max_connections=3, max_refusals=1)
    a, b, c = (Conn(n, evicted) for n in "abc")
    for conn in (a, b, c):
        assert slots.admit(conn) is Admission.SERVE
        slots.waiting(conn)
    slots.waiting(a)
    b.unsent = 100
    assert slots.admit(Conn("d", evicted)) is Admission.SERVE and evicted == ["c"]
    assert slots.admit(Conn("e", evicted)) is Admission.SERVE and evicted == ["c", "a"]
    assert slots.admit(Conn("f", evicted)) is Admission.REFUSE and evicted == ["c", "a"]
    b.unsent = 0
    assert slots.admit(Conn("g", evicted)) is Admission.SERVE and evicted == ["c", "a", "b"]
