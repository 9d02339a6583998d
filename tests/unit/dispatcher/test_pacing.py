"""The claim loop's sleep: the next due time, within the coalescing window and the longest sleep."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.dispatcher.pacing import claim_delay_ms

NOW = 1_800_000_000_000
due_in = st.one_of(st.none(), st.integers(-10_000, 10_000))
max_sleeps = st.integers(1, 60_000)
windows = st.integers(0, 1000)


@given(due_in, max_sleeps, windows)
def test_never_past_the_longest_sleep_nor_short_of_the_window(
    due: int | None, max_sleep: int, window: int
) -> None:
    delay = claim_delay_ms(None if due is None else NOW + due, NOW, max_sleep, window)
    assert 0 <= delay <= max_sleep
    assert delay >= min(window, max_sleep)


@given(st.integers(0, 10_000), max_sleeps, windows)
def test_wakes_when_the_next_is_due_past_the_window(due: int, max_sleep: int, window: int) -> None:
    delay = claim_delay_ms(NOW + due, NOW, max_sleep, window)
    if window <= due <= max_sleep:
        assert delay == due


def test_a_fire_due_within_the_window_waits_for_the_rest_of_it() -> None:
    assert claim_delay_ms(NOW + 1, NOW, 1000, 5) == 5
    assert claim_delay_ms(NOW - 3, NOW, 1000, 5) == 5
    assert claim_delay_ms(NOW + 1, NOW, 1000, 0) == 1
    assert claim_delay_ms(NOW - 3, NOW, 1000, 0) == 0
    assert claim_delay_ms(None, NOW, 1000, 5) == 1000
