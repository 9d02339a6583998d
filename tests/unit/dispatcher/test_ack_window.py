"""The router's acknowledgements: each names a tag still unsettled, and every command is
settled once it is finished, however slow the one before it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.dispatcher.router import AckWindow


def settle(acks: list[tuple[int, bool]], arrived: list[int], settled: set[int]) -> None:
    """Apply acks as the broker does, failing where it would close the channel."""
    for tag, multiple in acks:
        assert tag in arrived and tag not in settled, f"unknown delivery tag {tag}"
        settled.update(t for t in arrived if (t <= tag if multiple else t == tag))


@given(
    st.lists(st.integers(min_value=1, max_value=10**6), unique=True, max_size=60),
    st.data(),
)
def test_acks_settle_exactly_what_is_finished(tags: list[int], data: st.DataObject) -> None:
    tags.sort()
    window = AckWindow()
    for tag in tags:
        window.arrived(tag)
    order = data.draw(st.permutations(tags))
    # Finished in batches of any size, in any order.
    cuts = sorted(data.draw(st.sets(st.integers(0, len(order)), max_size=8)) | {len(order)})
    finished: set[int] = set()
    settled: set[int] = set()
    start = 0
    for cut in cuts:
        batch = order[start:cut]
        start = cut
        finished.update(batch)
        settle(window.finish(batch), tags, settled)
        # Never a command under way; always every finished one.
        assert settled == finished
    assert settled == set(tags)


def test_commands_in_a_row_go_in_one_frame_and_one_behind_a_split_goes_alone() -> None:
    window = AckWindow()
    for tag in (1, 2, 3, 4, 5):
        window.arrived(tag)
    assert window.finish([1, 3, 4]) == [(1, True), (3, False), (4, False)]  # 2: a split
    assert window.finish([5]) == [(5, False)]
    assert window.finish([2]) == [(2, True)]
