"""Which rebuild barrier an executor may answer (no I/O)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.executor.barrier import Barrier

#: settle (a settlement begins), end i (the i-th open one ends), learn (a newer request is
#: read), answer (what is answerable now is written and answered).
Step = tuple[str, int]
STEPS = st.lists(
    st.one_of(
        st.just(("settle", 0)),
        st.tuples(st.just("end"), st.integers(0, 7)),
        st.just(("learn", 0)),
        st.just(("answer", 0)),
    ),
    max_size=60,
)


@given(STEPS)
def test_a_request_is_answered_only_once_every_settlement_begun_before_it_was_read_ended(
    steps: list[Step],
) -> None:
    barrier = Barrier()
    open_tickets: list[int] = []
    #: Per request read: the tickets open (begun, not ended) when it was read.
    open_at_read: dict[int, set[int]] = {}
    ended: set[int] = set()
    requested = 0
    for op, arg in steps:
        if op == "settle":
            open_tickets.append(barrier.settling())
        elif op == "end" and open_tickets:
            ticket = open_tickets.pop(arg % len(open_tickets))
            barrier.settled(ticket)
            ended.add(ticket)
        elif op == "learn":
            requested += 1
            barrier.learn(requested)
            open_at_read[requested] = set(open_tickets)
        elif op == "answer":
            answer = barrier.answerable()
            assert answer >= barrier.answered
            if answer > barrier.answered:
                assert open_at_read[answer] <= ended
            barrier.answered = answer
    # With nothing open, the latest request read can always be answered.
    for ticket in open_tickets:
        barrier.settled(ticket)
    assert barrier.answerable() == requested


def test_settlements_begun_after_the_request_was_read_do_not_hold_it_back() -> None:
    barrier = Barrier()
    before = barrier.settling()
    barrier.learn(4)
    assert barrier.asked and barrier.answerable() == 0
    barrier.settling()  # begun after the read, still open
    barrier.settled(before)
    assert barrier.answerable() == 4
    barrier.answered = 4
    assert not barrier.asked
    barrier.learn(3)  # an older number read late changes nothing
    assert not barrier.asked and barrier.answerable() == 4
