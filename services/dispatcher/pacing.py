"""When the claim loop looks at Redis again (pure)."""

from __future__ import annotations


def claim_delay_ms(
    next_due_ms: int | None, now_ms: int, max_sleep_ms: float, coalesce_ms: int
) -> float:
    """Until the next occurrence comes due, but at least the coalescing window (what comes
    due within it is claimed and published together, one message for many fires) and at most
    the longest sleep (schedules written meanwhile wake the loop themselves)."""
    delay_ms = max_sleep_ms if next_due_ms is None else next_due_ms - now_ms
    return min(max(delay_ms, coalesce_ms, 0), max_sleep_ms)


def wakes_the_loop(fire_ms: int, now_ms: float, sleeping_until_ms: float, claiming: bool) -> bool:
    """Whether a schedule written to come due at ``fire_ms`` must wake the claim loop: it is
    due now, or before the loop's planned wake-up, or a claim is under way (it may have read
    the index before this write, and the sleep it plans next would not know of it)."""
    return claiming or fire_ms <= now_ms + 1 or fire_ms < sleeping_until_ms
