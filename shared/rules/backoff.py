"""Retry delays: exponential backoff with full jitter (pure; the random source is passed in)."""

from __future__ import annotations

import random

from shared.rules.plan import RetryRule

#: Beyond this exponent every realistic backoff is already at its cap.
_MAX_EXPONENT = 64


def ceiling_ms(rule: RetryRule, failed_attempt: int) -> int:
    """The backoff before the attempt after ``failed_attempt`` (1-based), before jitter."""
    exponent = min(max(failed_attempt - 1, 0), _MAX_EXPONENT)
    return int(min(float(rule.max_ms), rule.initial_ms * rule.multiplier**exponent))


def delay_ms(rule: RetryRule, failed_attempt: int, rng: random.Random) -> int:
    """How long to wait before retrying.

    With full jitter the wait is uniform in ``[0, ceiling]``: a herd that failed together
    retries spread out instead of hammering the target again at the same instant.
    """
    ceiling = ceiling_ms(rule, failed_attempt)
    return rng.randint(0, ceiling) if rule.full_jitter else ceiling


def attempts_left(rule: RetryRule, attempt: int) -> bool:
    """True when the attempt numbered ``attempt`` failed and another one is allowed."""
    return attempt < rule.max_attempts
