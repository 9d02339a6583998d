"""The router's acknowledgements: with ``multiple``, never past a command still under way."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.dispatcher.router import AckWindow


@given(st.lists(st.integers(min_value=1, max_value=10**6), unique=True, max_size=60), st.data())
def test_acknowledgements_rise_and_never_pass_a_command_under_way(
    tags: list[int], data: st.DataObject
) -> None:
    tags.sort()
    window = AckWindow()
    for tag in tags:
        window.arrived(tag)
    finished_order = data.draw(st.permutations(tags))
    finished: set[int] = set()
    acked = 0
    for tag in finished_order:
        finished.add(tag)
        last = window.finish(tag)
        if last is not None:
            assert last > acked
            # Everything up to it is finished: a multiple ack there covers only those.
            assert all(t in finished for t in tags if t <= last)
            acked = last
    assert acked == (tags[-1] if tags else 0)


def test_a_split_command_holds_back_the_acknowledgement_of_those_after_it() -> None:
    window = AckWindow()
    for tag in (1, 2, 3):
        window.arrived(tag)
    assert window.finish(1) == 1
    assert window.finish(3) is None  # 2 is a split command still waiting for its parts
    assert window.finish(2) == 3
