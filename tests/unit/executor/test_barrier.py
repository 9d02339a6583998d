"""Which rebuild barrier an executor may answer (no I/O)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.executor.barrier import Barrier

#: begin (an occurrence's delivery begins), end i (the i-th of those under way is settled),
#: learn (a newer request is read), answer (what is answerable now is written and answered).
Step = tuple[str, int]
STEPS = st.lists(
    st.one_of(
        st.just(("begin", 0)),
        st.tuples(st.just("end"), st.integers(0, 7)),
        st.just(("learn", 0)),
        st.just(("answer", 0)),
    ),
    max_size=60,
)


@given(STEPS)
def test_a_request_is_answered_only_once_every_occurrence_begun_before_it_was_read_is_settled(
    steps: list[Step],
) -> None:
    barrier = Barrier()
    under_way: list[int] = []
    #: Per request read: the occurrences under way when it was read.
    under_way_at_read: dict[int, set[int]] = {}
    settled: set[int] = set()
    requested = 0
    key = 0
    for op, arg in steps:
        if op == "begin":
            key += 1
            barrier.begin(key)
            under_way.append(key)
        elif op == "end" and under_way:
            done = under_way.pop(arg % len(under_way))
            barrier.end(done)
            settled.add(done)
        elif op == "learn":
            requested += 1
            barrier.learn(requested)
            under_way_at_read[requested] = set(under_way)
        elif op == "answer":
            answer = barrier.answerable()
            assert answer >= barrier.answered
            if answer > barrier.answered:
                assert under_way_at_read[answer] <= settled
            barrier.answered = answer
    # With nothing under way, the latest request read can always be answered.
    for done in under_way:
        barrier.end(done)
    assert barrier.answerable() == requested


def test_occurrences_begun_after_the_request_was_read_do_not_hold_it_back() -> None:
    barrier = Barrier()
    barrier.begin("before")
    barrier.learn(4)
    assert barrier.asked and barrier.answerable() == 0
    barrier.begin("after")  # begun after the read, still under way
    barrier.end("before")
    assert barrier.answerable() == 4
    barrier.answered = 4
    assert not barrier.asked
    barrier.learn(3)  # an older number read late changes nothing
    assert not barrier.asked and barrier.answerable() == 4
    barrier.end("never begun")  # parked or handed back twice: harmless
