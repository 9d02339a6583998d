"""When a schedule fires: nominal times, misfire decisions, jitter and identities (pure).

Every function takes the clock as an argument (``now_ms``) and does no I/O, so the executor,
the intake, the sweeper and ``cronbus preview`` all compute the same answers.

Vocabulary: a *nominal* time is when the rule says an occurrence is due; the *fire* time is
the nominal time plus the occurrence's deterministic jitter, and is what the index sorts by.
An occurrence is *missed* when its due time (the fire time: nominal plus jitter) is more than
the misfire grace before now; lateness is never measured from the nominal time alone.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
import zoneinfo
from datetime import UTC, tzinfo

from shared.contract import timefmt
from shared.rules import cron, exclusion
from shared.rules.plan import AfterCompletionRule, CronRule, IntervalRule, OnceRule, Plan

#: The namespace of the UUIDv5 idempotency keys (a fixed, arbitrary UUID: never change it).
IDEMPOTENCY_NAMESPACE = uuid.UUID("5c0f3f7e-2b8e-4c3a-9a51-0c7d3e0b6a11")
_KEY_PREFIX = IDEMPOTENCY_NAMESPACE.bytes


@functools.lru_cache(maxsize=1024)
def zone(name: str) -> tzinfo:
    return UTC if name == "UTC" else zoneinfo.ZoneInfo(name)


def _within_end(plan: Plan, nominal: int | None) -> int | None:
    if nominal is None or (plan.end_ms is not None and nominal > plan.end_ms):
        return None
    if nominal > timefmt.MAX_MS:
        # Past the year 9999 nothing can be formatted or stored: the rotation ends there.
        return None
    return nominal


def _interval_anchor(plan: Plan) -> int:
    return plan.start_ms if plan.start_ms is not None else 0


#: Most excluded spans one search steps over before it gives up (each step skips a whole
#: range, or the minute, hour or day a cron exclusion covers).
MAX_EXCLUDED_STEPS = 10_000


def exclusion_zone(plan: Plan) -> tzinfo:
    """The zone exclusions are read in: the cron rule's, else UTC."""
    return zone(plan.rule.timezone) if isinstance(plan.rule, CronRule) else UTC


def next_nominal(plan: Plan, after_ms: int) -> int | None:
    """The first nominal time strictly after ``after_ms`` inside the plan's window that is not
    excluded, or None.

    For ``after_completion`` there is no such time without a completion: use ``following``.
    """
    found, _ = next_nominal_counted(plan, after_ms)
    return found


def next_nominal_counted(plan: Plan, after_ms: int) -> tuple[int | None, int]:
    """``next_nominal`` and how many excluded times it stepped over to get there (counted up
    to ``MAX_COUNTED_PER_SPAN`` per excluded span of a cron rule)."""
    found = _next_by_rule(plan, after_ms)
    if not plan.exclude:
        return found, 0
    tz = exclusion_zone(plan)
    steps = skipped = 0
    while found is not None:
        resume = exclusion.skip_after(plan.exclude, tz, found)
        if resume is None:
            return found, skipped
        steps += 1
        if steps > MAX_EXCLUDED_STEPS:
            return None, skipped
        skipped += 1 + _rule_times_within(plan, found, resume)
        found = _next_by_rule(plan, resume)
    return None, skipped


#: A cron rule's excluded span holding more times than this counts as this many (an interval
#: rule's are counted exactly).
MAX_COUNTED_PER_SPAN = 1000


def _rule_times_within(plan: Plan, after_ms: int, until_ms: int) -> int:
    """How many rule times fall in ``(after_ms, until_ms]`` (capped for cron rules)."""
    rule = plan.rule
    if isinstance(rule, IntervalRule):
        return (until_ms - after_ms) // rule.every_ms
    count = 0
    current = _next_by_rule(plan, after_ms)
    while current is not None and current <= until_ms and count < MAX_COUNTED_PER_SPAN:
        count += 1
        current = _next_by_rule(plan, current)
    return count


def is_excluded(plan: Plan, nominal_ms: int) -> bool:
    return bool(plan.exclude) and exclusion.is_excluded(
        plan.exclude, exclusion_zone(plan), nominal_ms
    )


def _next_by_rule(plan: Plan, after_ms: int) -> int | None:
    """The rule's first time strictly after ``after_ms`` inside the window (exclusions not
    applied)."""
    rule = plan.rule
    if plan.start_ms is not None:
        after_ms = max(after_ms, plan.start_ms - 1)
    if isinstance(rule, CronRule):
        found = cron.next_fire_ms(cron.parse(rule.expr), zone(rule.timezone), after_ms)
    elif isinstance(rule, IntervalRule):
        anchor = _interval_anchor(plan)
        steps = 0 if after_ms < anchor else (after_ms - anchor) // rule.every_ms + 1
        found = anchor + steps * rule.every_ms
    elif isinstance(rule, OnceRule):
        found = rule.at_ms if rule.at_ms > after_ms else None
    else:
        found = None
    return _within_end(plan, found)


def previous_nominal(plan: Plan, before_ms: int, floor_ms: int) -> int | None:
    """The last nominal time in ``[floor_ms, before_ms)`` that is not excluded, or None."""
    found = _previous_by_rule(plan, before_ms, floor_ms)
    steps = 0
    while found is not None and is_excluded(plan, found):
        steps += 1
        if steps > MAX_EXCLUDED_STEPS:
            return None
        found = _previous_by_rule(plan, found, floor_ms)
    return found


def _previous_by_rule(plan: Plan, before_ms: int, floor_ms: int) -> int | None:
    rule = plan.rule
    if plan.end_ms is not None:
        before_ms = min(before_ms, plan.end_ms + 1)
    if plan.start_ms is not None:
        floor_ms = max(floor_ms, plan.start_ms)
    if isinstance(rule, IntervalRule):
        anchor = max(_interval_anchor(plan), floor_ms)
        base = _interval_anchor(plan)
        if before_ms <= anchor:
            return None
        found = base + (before_ms - 1 - base) // rule.every_ms * rule.every_ms
        return found if found >= floor_ms else None
    if isinstance(rule, OnceRule):
        return rule.at_ms if floor_ms <= rule.at_ms < before_ms else None
    if isinstance(rule, AfterCompletionRule):
        return None
    return _previous_by_search(plan, before_ms, floor_ms)


def _previous_by_search(plan: Plan, before_ms: int, floor_ms: int) -> int | None:
    """Previous fire of a rule that can only step forward: widen a window back from
    ``before_ms`` until it holds a fire, then step forward to the last one before it."""
    span = 1000
    while True:
        start = max(before_ms - span, floor_ms)
        found = _next_by_rule(plan, start - 1)
        if found is not None and found < before_ms:
            break
        if start == floor_ms:
            return None
        span *= 2
    while True:
        following_fire = _next_by_rule(plan, found)
        if following_fire is None or following_fire >= before_ms:
            return found
        found = following_fire


def first_nominal(plan: Plan, now_ms: int) -> int | None:
    """Where a new (or reset) rotation starts: the first nominal time at or after now.

    A ``once`` in the past is returned as is: the misfire policy decides whether it still fires.
    """
    rule = plan.rule
    if isinstance(rule, OnceRule):
        at = _within_start(plan, rule.at_ms)
        return None if at is None or is_excluded(plan, at) else at
    if isinstance(rule, AfterCompletionRule):
        first = plan.start_ms if plan.start_ms is not None else now_ms + rule.delay_ms
        return _within_end(plan, _delay_past_exclusions(plan, first)[0])
    return next_nominal(plan, now_ms - 1)


def _delay_past_exclusions(plan: Plan, nominal_ms: int) -> tuple[int, int]:
    """A fixed-delay time moved to the end of the excluded span it falls in (if any), and
    how many spans it was moved over."""
    if not plan.exclude:
        return nominal_ms, 0
    tz = exclusion_zone(plan)
    steps = 0
    while steps <= MAX_EXCLUDED_STEPS:
        resume = exclusion.skip_after(plan.exclude, tz, nominal_ms)
        if resume is None:
            break
        nominal_ms = resume + 1
        steps += 1
    return nominal_ms, steps


def _within_start(plan: Plan, nominal: int) -> int | None:
    if plan.start_ms is not None and nominal < plan.start_ms:
        return None
    return _within_end(plan, nominal)


def following(plan: Plan, nominal_ms: int, finished_ms: int) -> int | None:
    """The rule's next nominal time after the occurrence at ``nominal_ms`` (misfire not applied)."""
    return following_counted(plan, nominal_ms, finished_ms)[0]


def following_counted(plan: Plan, nominal_ms: int, finished_ms: int) -> tuple[int | None, int]:
    """``following``, and how many excluded spans were stepped over to reach it."""
    if isinstance(plan.rule, AfterCompletionRule):
        moved, steps = _delay_past_exclusions(plan, finished_ms + plan.rule.delay_ms)
        return _within_end(plan, moved), steps
    return next_nominal_counted(plan, nominal_ms)


def resolve_due(plan: Plan, candidate_ms: int | None, now_ms: int, member: str = "") -> int | None:
    """The nominal time that should fire next, given the rule's next one is ``candidate_ms``.

    An occurrence is missed when its *due* time (nominal plus its jitter offset, which needs
    the schedule's ``member``) is more than the grace before now: jitter is never lateness.
    On time, the candidate fires. Missed: ``skip`` jumps to the first time that is on time,
    ``fire_once`` fires one catch-up (the latest missed time), ``fire_all`` replays missed
    times oldest first, at most ``limit`` of them and none older than ``window``. A fixed-delay
    rule is never missed: it is simply late. None: no more fires.
    """
    if candidate_ms is None or isinstance(plan.rule, AfterCompletionRule):
        return candidate_ms
    if not is_missed(plan, member, candidate_ms, now_ms):
        return candidate_ms
    misfire = plan.misfire
    missed_before = now_ms - misfire.grace_ms
    on_time = first_on_time(plan, member, candidate_ms, missed_before)
    if misfire.policy == "skip":
        return on_time
    # Every nominal time in [candidate, bound) is missed.
    bound = missed_before if on_time is None else on_time
    if misfire.policy == "fire_once":
        return previous_nominal(plan, bound, candidate_ms)
    # The window bounds lateness too: it is measured from each occurrence's due time.
    oldest_in_window = first_on_time(plan, member, candidate_ms, now_ms - misfire.window_ms)
    if oldest_in_window is None or oldest_in_window >= bound:
        return on_time
    return _replay_start(plan, oldest_in_window, bound)


def is_missed(plan: Plan, member: str, nominal_ms: int, now_ms: int) -> bool:
    """Whether the occurrence's due time (nominal + jitter) is more than the grace before now.
    A fixed-delay rule is never missed."""
    if isinstance(plan.rule, AfterCompletionRule):
        return False
    return fire_at_ms(plan, member, nominal_ms) < now_ms - plan.misfire.grace_ms


#: Most nominal times examined one by one when jitter spans many of them.
_ON_TIME_SEARCH_STEPS = 10_000


def first_on_time(plan: Plan, member: str, candidate_ms: int, missed_before: int) -> int | None:
    """The first nominal time at or after ``candidate_ms`` whose due time (nominal + jitter) is
    not before ``missed_before``; None when the rule has no such time.

    Times before ``missed_before - jitter`` are missed whatever their offset, and times at or
    after ``missed_before`` are on time whatever their offset: only the span between is walked.
    """
    start = max(candidate_ms, missed_before - plan.jitter_ms)
    current = candidate_ms if start == candidate_ms else next_nominal(plan, start - 1)
    for _ in range(_ON_TIME_SEARCH_STEPS):
        if current is None or current >= missed_before:
            return current
        if fire_at_ms(plan, member, current) >= missed_before:
            return current
        current = next_nominal(plan, current)
    return next_nominal(plan, missed_before - 1)


def _replay_start(plan: Plan, first: int, missed_before: int) -> int:
    """fire_all: the oldest missed time still to replay, from ``first`` (the oldest within the
    window) but at most ``limit`` of them before ``missed_before`` (the first on-time nominal,
    or the grace line)."""
    limit = plan.misfire.limit
    if _count_missed(plan, first, missed_before, limit + 1) <= limit:
        return first
    # More than `limit` missed: walk back from the end to the limit-th latest one.
    oldest = missed_before
    for _ in range(limit):
        earlier = previous_nominal(plan, oldest, first)
        if earlier is None:
            break
        oldest = earlier
    return oldest


def _count_missed(plan: Plan, first: int, missed_before: int, stop_at: int) -> int:
    rule = plan.rule
    if isinstance(rule, IntervalRule) and not plan.exclude:
        return min(stop_at, (missed_before - 1 - first) // rule.every_ms + 1)
    count = 0
    current: int | None = first
    while current is not None and current < missed_before and count < stop_at:
        count += 1
        current = next_nominal(plan, current)
    return count


def is_exhausted(plan: Plan, fires: int) -> bool:
    """True when the schedule has fired ``max_fires`` regular occurrences."""
    return plan.max_fires is not None and fires >= plan.max_fires


def jitter_offset_ms(plan: Plan, member: str, nominal_ms: int) -> int:
    """A deterministic offset in ``[0, jitter)`` from the occurrence identity.

    Hashing the identity (not drawing at random) means recomputing an occurrence never moves it.
    """
    if plan.jitter_ms <= 0:
        return 0
    digest = hashlib.blake2b(f"{member}@{nominal_ms}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % plan.jitter_ms


def fire_at_ms(plan: Plan, member: str, nominal_ms: int) -> int:
    return nominal_ms + jitter_offset_ms(plan, member, nominal_ms)


def idempotency_key(namespace: str, schedule_id: str, nominal_ms: int) -> str:
    """The key of a regular occurrence: derived from its identity and nothing else, so every
    re-delivery repeats it. Never change the name hashed here: keys are stable across versions.
    """
    return _uuid5(f"{namespace}/{schedule_id}@{nominal_ms}")


def trigger_key(namespace: str, schedule_id: str, trigger_ms: int) -> str:
    """The key of a triggered run: its identity is (namespace, id, trigger time, *trigger*).

    The ``#trigger`` suffix keeps it apart from the regular occurrence at the same instant (a
    regular name never holds ``#``: ids may not contain it).
    """
    return _uuid5(f"{namespace}/{schedule_id}@{trigger_ms}#trigger")


def occurrence_key(namespace: str, schedule_id: str, nominal_ms: int, *, trigger: bool) -> str:
    """The idempotency key of a regular occurrence or of a triggered run."""
    if trigger:
        return trigger_key(namespace, schedule_id, nominal_ms)
    return idempotency_key(namespace, schedule_id, nominal_ms)


def _uuid5(name: str) -> str:
    """A UUIDv5 (RFC 4122: SHA-1 of the namespace UUID and the name, version and variant bits
    set), built directly rather than through ``uuid.uuid5``: it is on every delivery's path.
    """
    digest = bytearray(
        hashlib.sha1(_KEY_PREFIX + name.encode(), usedforsecurity=False).digest()[:16]
    )
    digest[6] = (digest[6] & 0x0F) | 0x50
    digest[8] = (digest[8] & 0x3F) | 0x80
    text = digest.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def upcoming(plan: Plan, now_ms: int, count: int, fires: int = 0) -> list[int]:
    """The next ``count`` nominal times from now (for replies and previews)."""
    remaining = None if plan.max_fires is None else max(plan.max_fires - fires, 0)
    limit = count if remaining is None else min(count, remaining)
    result: list[int] = []
    current = first_nominal(plan, now_ms)
    while current is not None and len(result) < limit:
        result.append(current)
        if isinstance(plan.rule, AfterCompletionRule):
            break
        current = next_nominal(plan, current)
    return result
