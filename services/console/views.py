"""The console's pure parts: query bounds, filters, upcoming fires with DST marks, the SVG chart.

No I/O here: every function takes what it needs (the clock included) and is unit-tested.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

from shared.rules import schedule
from shared.rules.plan import CronRule, Plan

#: Above every id the contract allows (ids are ASCII): the open end of a list's range.
TOP = "\U0010ffff"
_SURROGATES = range(0xD800, 0xE000)


class BadQuery(ValueError):
    """A query parameter that cannot be used; the message names it and says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def prefix_bounds(prefix: str) -> tuple[str, str]:
    """[low, high) in byte order (UTF-8, i.e. code point order) holding every string that
    starts with ``prefix``: one index range instead of a scan."""
    stem = prefix.rstrip(TOP)
    if not stem:
        # Nothing to increment (ids are ASCII, so TOP still closes the range for every id).
        return prefix, TOP
    following = ord(stem[-1]) + 1
    if following in _SURROGATES:
        following = _SURROGATES.stop
    return prefix, stem[:-1] + chr(following)


def parse_label(text: str) -> tuple[str, str] | None:
    """``key=value`` -> (key, value); empty text -> None."""
    text = text.strip()
    if not text:
        return None
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise BadQuery("label", "must be key=value")
    return key.strip(), value.strip()


def parse_state(text: str, states: Sequence[str]) -> str | None:
    if not text:
        return None
    if text not in states:
        raise BadQuery("state", f"must be one of {', '.join(states)}")
    return text


def check_text(field: str, text: str, limit: int = 200) -> str:
    """Free text of a query (search, cursor): bounded, and no NUL (PostgreSQL refuses it)."""
    if len(text) > limit:
        raise BadQuery(field, f"is longer than {limit} characters")
    if "\x00" in text:
        raise BadQuery(field, "contains a NUL character")
    return text


def attempt_of(occ: bytes | str | None) -> int | None:
    """The attempt number of an index occurrence state ``nominal|attempt|token|fires``."""
    if occ is None:
        return None
    text = occ.decode() if isinstance(occ, bytes) else occ
    parts = text.split("|")
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    return int(parts[1])


@dataclass(frozen=True, slots=True)
class Attempt:
    """One delivery attempt of an execution, as the console lists it."""

    attempt: int
    http_status: int | None
    error: str | None
    started_ms: int
    finished_ms: int

    @property
    def took_ms(self) -> int:
        return self.finished_ms - self.started_ms

    @property
    def started(self) -> str:
        return utc_text(dt.datetime.fromtimestamp(self.started_ms / 1000, dt.UTC))


#: Failed attempts an Error cell names before it says how many more there were.
ERRORS_SHOWN = 2


def attempt_error(attempt: Attempt) -> str:
    """What went wrong in one failed attempt: its error, else its HTTP status."""
    if attempt.error:
        return attempt.error
    return f"HTTP {attempt.http_status}" if attempt.http_status is not None else "failed"


def error_text(error: str | None, failed: Sequence[Attempt]) -> str:
    """An execution's Error cell: the row's own error (its latest attempt's), else the failed
    attempts before a success, first first (``attempt 1: HTTP 503``); empty when none failed.

    A run that needed two attempts ended well, but what its first one met is what a person
    looks for on a flaky schedule's page.
    """
    if error:
        return error
    said = [f"attempt {a.attempt}: {attempt_error(a)}" for a in failed[:ERRORS_SHOWN]]
    more = len(failed) - ERRORS_SHOWN
    if more > 0:
        said.append(f"{more} more failed")
    return "; ".join(said)


def attempts_of(log: object) -> tuple[Attempt, ...]:
    """``executions.failed_attempts`` -> one Attempt per attempt number, oldest first (a
    redelivered attempt is logged twice; anything malformed is left out)."""
    found: dict[int, Attempt] = {}
    for entry in log if isinstance(log, list) else []:
        if not isinstance(entry, dict):
            continue
        try:
            number = int(entry["attempt"])
            status = entry.get("http_status")
            found[number] = Attempt(
                number,
                None if status is None else int(status),
                None if entry.get("error") is None else str(entry["error"]),
                int(entry["started_ms"]),
                int(entry["finished_ms"]),
            )
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(found[n] for n in sorted(found))


MINUTE_MS = 60_000
#: The shortest stretch a rate is given over: over less, the first fire or two would read as a
#: rate (or the lack of them as 0 beside "1 fire in the last hour").
MIN_RATE_WINDOW_MS = MINUTE_MS


def rate_window_start(now_ms: int, minutes: int, first_minute_ms: int | None) -> int | None:
    """Where a namespace's per-minute rates start counting, up to now: ``minutes`` whole minutes
    before the current one (which is counted so far, over the time it has run), or the start of
    the namespace's first recorded minute (``first_minute_ms``) when its deliveries began since:
    over a window it was not recorded in, a new namespace's rate read 0 beside its first fires.

    None when that leaves less than MIN_RATE_WINDOW_MS: too short to say a rate ("—").
    """
    start = now_ms - now_ms % MINUTE_MS - minutes * MINUTE_MS
    if first_minute_ms is not None:
        start = max(start, first_minute_ms)
    return start if now_ms - start >= MIN_RATE_WINDOW_MS else None


def per_minute(count: int, start_ms: int | None, now_ms: int) -> float | None:
    """``count`` deliveries since ``start_ms`` as a rate per minute; None without a window."""
    if start_ms is None:
        return None
    return count * MINUTE_MS / max(now_ms - start_ms, 1)


def rate_text(per_min: float | None) -> str:
    """Deliveries per minute as a person reads them: ``0``, ``0.4/min``, ``12/min``, ``3.2/s``;
    ``—`` for no rate yet (less than a minute recorded)."""
    if per_min is None:
        return "—"
    if per_min <= 0:
        return "0"
    if per_min >= 120:
        return f"{per_min / 60:.1f}/s"
    return f"{per_min:.1f}/min" if per_min < 10 else f"{per_min:.0f}/min"


def duration_text(ms: int) -> str:
    """A wait as a person reads it: ``850 ms``, ``42 s``, ``7 min 5 s``, ``5 d 9 h``."""
    if ms < 1000:
        return f"{max(ms, 0)} ms"
    seconds = ms // 1000
    units = (("d", 86400), ("h", 3600), ("min", 60), ("s", 1))
    parts: list[str] = []
    for name, size in units:
        count, seconds = divmod(seconds, size)
        if count or parts:
            parts.append(f"{count} {name}")
        if len(parts) == 2:
            break
    return " ".join(p for p in parts if not p.startswith("0 ")) or "0 s"


def utc_text(value: dt.datetime | None) -> str:
    if value is None:
        return "—"
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") + "Z"


def offset_text(offset: dt.timedelta | None) -> str:
    minutes = round((offset or dt.timedelta()).total_seconds() / 60)
    sign = "+" if minutes >= 0 else "-"
    hours, rest = divmod(abs(minutes), 60)
    return f"UTC{sign}{hours:02d}:{rest:02d}"


@dataclass(frozen=True, slots=True)
class FireRow:
    utc: str
    local: str
    #: Set on the first fire after the zone's offset changed (a DST shift), saying how.
    shift: str | None
    #: Set when the local time exists twice (the repeated hour when clocks go back).
    repeated: bool


def zone_name(plan: Plan) -> str:
    return plan.rule.timezone if isinstance(plan.rule, CronRule) else "UTC"


def _repeated(local: dt.datetime) -> bool:
    other = local.replace(fold=1 - local.fold)
    return other.utcoffset() != local.utcoffset()


def upcoming_fires(plan: Plan, now_ms: int, fires: int, count: int = 10) -> list[FireRow]:
    """The next ``count`` nominal fires in UTC and in the schedule's zone, DST shifts marked."""
    tz = schedule.zone(zone_name(plan))
    previous = dt.datetime.fromtimestamp(now_ms / 1000, dt.UTC).astimezone(tz).utcoffset()
    rows = []
    for fire_ms in schedule.upcoming(plan, now_ms, count, fires):
        at = dt.datetime.fromtimestamp(fire_ms / 1000, dt.UTC)
        local = at.astimezone(tz)
        offset = local.utcoffset()
        shift = None
        if offset != previous:
            shift = f"clocks changed: {offset_text(previous)} → {offset_text(offset)}"
        previous = offset
        rows.append(
            FireRow(
                utc=utc_text(at),
                local=f"{local:%Y-%m-%d %H:%M:%S} {local.tzname()} ({offset_text(offset)})",
                shift=shift,
                repeated=_repeated(local),
            )
        )
    return rows


def quantile(values: Sequence[int], q: float) -> int | None:
    """Nearest-rank quantile (q in [0, 1])."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(math.ceil(q * len(ordered)), 1)
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class Point:
    """One execution on the lateness chart."""

    label: str
    lateness_ms: int
    failed: bool


CHART_WIDTH = 640
CHART_HEIGHT = 160
#: Room left of the bars for the axis label (``59 min 59 s`` at the tick's size).
_PAD = 72


def lateness_text(ms: int | None) -> str:
    """A lateness with its unit: ``19 ms``, ``1.0 s``, ``7 min 5 s``."""
    if ms is None:
        return "—"
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return duration_text(ms)


@dataclass(frozen=True, slots=True)
class LatenessSummary:
    count: int
    failed: int
    p50: str
    p99: str
    #: Backfilled deliveries left out (they replay the past: late by definition).
    backfills: int


def lateness_summary(executions: Sequence[tuple[int, bool, bool]]) -> LatenessSummary:
    """From (lateness ms, failed, is backfill) per execution: the quantiles of the others."""
    timely = [late for late, _, backfill in executions if not backfill]
    return LatenessSummary(
        count=len(timely),
        failed=sum(1 for _, failed, backfill in executions if failed and not backfill),
        p50=lateness_text(quantile(timely, 0.5)),
        p99=lateness_text(quantile(timely, 0.99)),
        backfills=len(executions) - len(timely),
    )


def lateness_chart(points: Sequence[Point]) -> Markup:
    """An inline SVG bar chart of lateness, oldest left; failed executions drawn in red.

    Built server-side, so the page needs no script; each bar has a <title> (hover text, and
    read out by screen readers), and every text is escaped.
    """
    if not points:
        return Markup("")
    top = max(*(p.lateness_ms for p in points), 1)
    inner_w, inner_h = CHART_WIDTH - _PAD - 4, CHART_HEIGHT - 24
    step = inner_w / len(points)
    bar = max(step * 0.8, 1.0)
    parts = [
        f'<svg class="chart" viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}" width="100%" '
        f'role="img" aria-labelledby="chart-title" xmlns="http://www.w3.org/2000/svg">',
        f'<title id="chart-title">Lateness of the last {len(points)} executions, '
        f"oldest left, highest {escape(lateness_text(top))}</title>",
        f'<line x1="{_PAD}" y1="{inner_h + 4}" x2="{CHART_WIDTH - 4}" y2="{inner_h + 4}" '
        'class="axis"/>',
        f'<text x="{_PAD - 4}" y="12" text-anchor="end" class="tick">'
        f"{escape(lateness_text(top))}</text>",
        f'<text x="{_PAD - 4}" y="{inner_h + 4}" text-anchor="end" class="tick">0</text>',
    ]
    for i, point in enumerate(points):
        height = max(point.lateness_ms, 0) / top * inner_h
        x = _PAD + i * step
        y = inner_h + 4 - height
        kind = "bar failed" if point.failed else "bar"
        title = escape(f"{point.label}: {lateness_text(point.lateness_ms)} late")
        parts.append(
            f'<rect class="{kind}" x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" '
            f'height="{max(height, 0.5):.1f}"><title>{title}</title></rect>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))
