"""The claim loop's sleep: the next due time, within the coalescing window and the longest sleep."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from services.dispatcher.dispatcher import Dispatcher
from services.dispatcher.pacing import claim_delay_ms, wakes_the_loop
from shared.runtime.config import DispatcherSettings

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


@given(st.integers(-10_000, 10_000), st.integers(0, 60_000), st.booleans())
def test_a_write_wakes_the_loop_when_its_sleep_would_not_know_of_it(
    due: int, sleeping_for: int, claiming: bool
) -> None:
    sleeping_until = NOW + sleeping_for if sleeping_for else 0
    woken = wakes_the_loop(NOW + due, NOW, sleeping_until, claiming)
    # A claim under way may have read the index before this write: the sleep it plans next
    # would not know of it, however far off it comes due.
    due_before_the_wake_up = sleeping_until != 0 and NOW + due < sleeping_until
    assert woken == (claiming or due <= 1 or due_before_the_wake_up)


def test_a_write_due_after_the_planned_wake_up_lets_the_loop_sleep() -> None:
    assert not wakes_the_loop(NOW + 5000, NOW, NOW + 1000, claiming=False)
    assert wakes_the_loop(NOW + 500, NOW, NOW + 1000, claiming=False)
    assert wakes_the_loop(NOW + 5000, NOW, 0, claiming=True)


def test_the_dispatcher_takes_a_write_during_its_claim_as_a_wake_up() -> None:
    """Before, a schedule written while a claim was under way, due later than 1 ms, woke
    nothing: the loop then slept as its claim had planned, up to CRONBUS_MAX_SLEEP_S."""
    unused: Any = None
    dispatcher = Dispatcher(DispatcherSettings(), unused, unused, asyncio.Event())
    far = int(time.time() * 1000) + 60_000
    dispatcher.wake(far)
    assert not dispatcher.wake_event.is_set()
    dispatcher._claiming = True
    dispatcher.wake(far)
    assert dispatcher.wake_event.is_set()
