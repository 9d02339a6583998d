"""Exclusions (``spec.exclude``): nominal times a schedule skips, such as holidays (pure).

An exclusion is a cron expression matched against the occurrence's local time in the
schedule's zone (UTC for specs that have no zone), or a ``[from, to)`` range of instants. A
5-field cron matches a whole minute (every second of it); a 6-field cron matches one second.

``skip_after`` answers, for a nominal time, whether it is excluded and from where the rule's
next time should be searched: the end of the whole excluded span (the end of a range, or of the
minute, hour or local day a cron exclusion covers), so a day-long holiday costs one step, not
86,400, for a schedule that fires every second.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo

from shared.rules import cron

_MINUTE_MS = 60_000


@dataclass(frozen=True, slots=True)
class CronExclusion:
    expr: str


@dataclass(frozen=True, slots=True)
class RangeExclusion:
    #: Inclusive start (epoch ms).
    from_ms: int
    #: Exclusive end (epoch ms).
    to_ms: int


Exclusion = CronExclusion | RangeExclusion


@functools.lru_cache(maxsize=4096)
def _parsed(expr: str) -> tuple[cron.CronExpr, bool]:
    """The parsed expression and whether it has a seconds field (6 fields)."""
    return cron.parse(expr), len(expr.split()) == 6


def _day_matches(expr: cron.CronExpr, local: datetime) -> bool:
    if local.month not in expr.months:
        return False
    dom = local.day in expr.days_of_month
    dow = (local.weekday() + 1) % 7 in expr.days_of_week
    if expr.dom_restricted and expr.dow_restricted:
        return dom or dow
    return dom and dow


def cron_matches(expr_text: str, local: datetime) -> bool:
    """Whether the local wall time ``local`` matches the exclusion's cron expression."""
    expr, has_seconds = _parsed(expr_text)
    if has_seconds and local.second not in expr.seconds:
        return False
    return local.minute in expr.minutes and local.hour in expr.hours and _day_matches(expr, local)


def _span_end_ms(expr_text: str, local: datetime, at_ms: int, zone: tzinfo) -> int:
    """The end (exclusive, epoch ms) of the span around ``at_ms`` the matching cron covers:
    one second for a seconds field that is not a wildcard, else the minute, else the hour,
    else the local day."""
    expr, has_seconds = _parsed(expr_text)
    if has_seconds and len(expr.seconds) < 60:
        return at_ms - at_ms % 1000 + 1000
    minute_end = at_ms - (local.second * 1000 + local.microsecond // 1000) + _MINUTE_MS
    if len(expr.minutes) < 60:
        return minute_end
    hour_end = minute_end + (59 - local.minute) * _MINUTE_MS
    if len(expr.hours) < 24:
        return hour_end
    next_day = (local.replace(tzinfo=None) + timedelta(days=1)).replace(
        hour=0, minute=0, second=0, microsecond=0
    )
    day_end = int(next_day.replace(tzinfo=zone).timestamp() * 1000)
    # A gap or fold at midnight could put the local midnight before the hour's end.
    return max(day_end, hour_end)


def skip_after(exclusions: tuple[Exclusion, ...], zone: tzinfo, nominal_ms: int) -> int | None:
    """None when ``nominal_ms`` is not excluded; else the instant (epoch ms) strictly after
    which the rule's next time should be searched (the end of the excluded span, minus 1)."""
    local: datetime | None = None
    end: int | None = None
    for item in exclusions:
        if isinstance(item, RangeExclusion):
            if item.from_ms <= nominal_ms < item.to_ms:
                end = max(end or 0, item.to_ms)
            continue
        if local is None:
            local = datetime.fromtimestamp(nominal_ms / 1000, zone)
        if cron_matches(item.expr, local):
            end = max(end or 0, _span_end_ms(item.expr, local, nominal_ms, zone))
    return None if end is None else max(end - 1, nominal_ms)


def is_excluded(exclusions: tuple[Exclusion, ...], zone: tzinfo, nominal_ms: int) -> bool:
    return skip_after(exclusions, zone, nominal_ms) is not None
