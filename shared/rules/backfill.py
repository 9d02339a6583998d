"""Backfills: which nominal occurrences of a schedule fall in ``[from, to)`` (pure, no I/O).

A backfill replays a schedule's past: each nominal time in ``[from, to)`` that the schedule's
rule gives, inside its ``start_at``/``end_at`` and not excluded by ``spec.exclude``, oldest
first, at most ``limit`` of them. The intake counts them and places the first; each
completion computes the next with ``next_after`` (the same schedule math the rotation uses),
and complete.lua stops at ``to`` or when the count is reached, so the chain delivered is the
list ``occurrences`` gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from shared.rules import schedule
from shared.rules.plan import AfterCompletionRule, IntervalRule, Plan

#: Occurrences one backfill delivers when the command does not say.
DEFAULT_LIMIT: Final = 1000
#: Most occurrences one backfill may deliver.
MAX_LIMIT: Final = 100_000


def has_nominal_times(plan: Plan) -> bool:
    """A fixed-delay schedule (``after_completion``) has no nominal times to replay: each of its
    times is known only once the previous run finished."""
    return not isinstance(plan.rule, AfterCompletionRule)


def next_after(plan: Plan, nominal_ms: int) -> int | None:
    """The schedule's next nominal time strictly after ``nominal_ms`` (inside its window, not
    excluded), or None."""
    if not has_nominal_times(plan):
        return None
    return schedule.next_nominal(plan, nominal_ms)


def first_in(plan: Plan, from_ms: int, to_ms: int) -> int | None:
    """The first nominal time in ``[from_ms, to_ms)``, or None."""
    found = next_after(plan, from_ms - 1)
    return found if found is not None and found < to_ms else None


def occurrences(plan: Plan, from_ms: int, to_ms: int, limit: int) -> Iterator[int]:
    """The nominal times a backfill delivers, oldest first."""
    current = first_in(plan, from_ms, to_ms)
    count = 0
    while current is not None and current < to_ms and count < limit:
        yield current
        count += 1
        current = next_after(plan, current)


@dataclass(frozen=True, slots=True)
class Extent:
    """What a backfill will deliver: how many occurrences, and the first one's nominal time."""

    occurrences: int
    first_ms: int | None


def _interval_count(plan: Plan, rule: IntervalRule, first_ms: int, to_ms: int, limit: int) -> int:
    """Grid points from ``first_ms`` (itself one) below ``to_ms`` and not past ``end_at``."""
    upper = to_ms if plan.end_ms is None else min(to_ms, plan.end_ms + 1)
    if upper <= first_ms:
        return 0
    return min(limit, (upper - first_ms + rule.every_ms - 1) // rule.every_ms)


def extent(plan: Plan, from_ms: int, to_ms: int, limit: int) -> Extent:
    """``occurrences`` counted. An interval rule without exclusions is counted by arithmetic
    (a backfill of 100,000 occurrences answers at once); others are walked, at most ``limit``
    steps."""
    first = first_in(plan, from_ms, to_ms)
    if first is None:
        return Extent(0, None)
    rule = plan.rule
    if isinstance(rule, IntervalRule) and not plan.exclude:
        return Extent(_interval_count(plan, rule, first, to_ms, limit), first)
    count = sum(1 for _ in occurrences(plan, from_ms, to_ms, limit))
    return Extent(count, first)
