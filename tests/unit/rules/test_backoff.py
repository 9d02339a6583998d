"""Exponential backoff with full jitter."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from shared.rules import backoff
from shared.rules.plan import RetryRule

rules = st.builds(
    RetryRule,
    st.integers(1, 100),
    st.integers(1, 10**6),
    st.floats(1, 100),
    st.integers(1, 10**8),
    st.booleans(),
).filter(lambda r: r.max_ms >= r.initial_ms)


def test_doubling_until_the_cap() -> None:
    rule = RetryRule(
        max_attempts=10, initial_ms=1000, multiplier=2, max_ms=60_000, full_jitter=False
    )
    rng = random.Random(0)
    assert [backoff.delay_ms(rule, attempt, rng) for attempt in range(1, 9)] == [
        1000,
        2000,
        4000,
        8000,
        16_000,
        32_000,
        60_000,
        60_000,
    ]


@given(rules, st.integers(1, 1000), st.integers(0, 2**32))
def test_delays_are_capped_and_jitter_stays_within_the_ceiling(
    rule: RetryRule, attempt: int, seed: int
) -> None:
    ceiling = backoff.ceiling_ms(rule, attempt)
    assert 0 <= ceiling <= rule.max_ms
    assert ceiling >= min(rule.initial_ms, rule.max_ms)
    delay = backoff.delay_ms(rule, attempt, random.Random(seed))
    assert 0 <= delay <= ceiling
    if not rule.full_jitter:
        assert delay == ceiling


@given(rules, st.integers(1, 200))
def test_the_ceiling_never_shrinks(rule: RetryRule, attempt: int) -> None:
    assert backoff.ceiling_ms(rule, attempt + 1) >= backoff.ceiling_ms(rule, attempt)


def test_full_jitter_spreads_a_herd() -> None:
    rule = RetryRule(initial_ms=10_000, max_ms=10_000)
    rng = random.Random(7)
    delays = {backoff.delay_ms(rule, 1, rng) for _ in range(1000)}
    assert len(delays) > 900 and min(delays) < 1000 and max(delays) > 9000


def test_attempts_left() -> None:
    rule = RetryRule(max_attempts=3)
    assert [backoff.attempts_left(rule, n) for n in (1, 2, 3)] == [True, True, False]
