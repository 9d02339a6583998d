"""Cron expressions: parsing, and the next fire instant in a time zone.

Syntax: 5 fields `minute hour day-of-month month day-of-week`, or 6 fields with the seconds
first (Quartz / BullMQ style). Each field takes `*`, `?` (day-of-month and day-of-week only),
numbers, ranges `a-b`, steps `*/n`, `a-b/n` and `a/n`, comma lists, and names for months
(JAN..DEC) and days of week (SUN..SAT). Day of week 7 is Sunday, like 0. Macros: @yearly,
@annually, @monthly, @weekly, @daily, @midnight, @hourly.

Semantics follow Vixie cron. When both day-of-month and day-of-week are restricted (they do not
start with `*` or `?`) a day matches if either matches; otherwise it must match both, which
amounts to "the restricted one applies" because an unrestricted `*` matches every day.

Daylight saving time: a "fixed" hour field (numbers, lists, ranges) fires each matching wall
time once per local day: a wall time skipped by a spring-forward gap fires shifted forward by
the gap (PEP 495 fold=0), a wall time repeated by a fall-back fires the first time only. A
"wildcard" hour field (`*`, `*/n`, any `/` step) fires at every real instant whose wall time
matches: both passes of a repeated hour, nothing inside a gap.

All instants are Unix epoch milliseconds; fires are always whole seconds.
"""

from __future__ import annotations

import calendar
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, tzinfo

__all__ = [
    "SEARCH_HORIZON_YEARS",
    "CronError",
    "CronExpr",
    "fires_between",
    "next_fire_ms",
    "parse",
]

SEARCH_HORIZON_YEARS = 10

_DAY = 86_400
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
# The day layout looks one day back and two days ahead, so keep clear of datetime's limits.
_MIN_ORDINAL = date.min.toordinal() + 3
_MAX_ORDINAL = date.max.toordinal() - 3
_MAX_DIGITS = 6
_DAYS_IN_MONTH = (0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


class CronError(ValueError):
    """The expression is not valid cron.

    `reason` is one short sentence without a field path (the caller adds its own prefix).
    """

    reason: str

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _FieldSpec:
    name: str
    low: int
    high: int
    # Where `*` and `a/n` stop; differs from `high` only for day-of-week, whose 7 is an alias.
    natural_end: int
    names: Mapping[str, int]
    accepts_question_mark: bool


_MONTH_NAMES = {name.upper(): number for number, name in enumerate(calendar.month_abbr) if name}
_DAY_NAMES = {"SUN": 0, "MON": 1, "TUE": 2, "WED": 3, "THU": 4, "FRI": 5, "SAT": 6}

_SECOND = _FieldSpec("second", 0, 59, 59, {}, False)
_MINUTE = _FieldSpec("minute", 0, 59, 59, {}, False)
_HOUR = _FieldSpec("hour", 0, 23, 23, {}, False)
_DAY_OF_MONTH = _FieldSpec("day-of-month", 1, 31, 31, {}, True)
_MONTH = _FieldSpec("month", 1, 12, 12, _MONTH_NAMES, False)
_DAY_OF_WEEK = _FieldSpec("day-of-week", 0, 7, 6, _DAY_NAMES, True)
_FIELDS = (_SECOND, _MINUTE, _HOUR, _DAY_OF_MONTH, _MONTH, _DAY_OF_WEEK)

_ALLOWED_CHARACTERS = frozenset(
    "0123456789*?,-/abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
_UNRESTRICTED_MARKS = ("*", "?")

_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


def _field_error(spec: _FieldSpec, problem: str) -> CronError:
    return CronError(f"{spec.name}: {problem}")


@functools.lru_cache(maxsize=4096)
def parse(expr: str) -> CronExpr:
    """Parse a cron expression; raises CronError with a one-sentence reason."""
    text = expr.strip()
    if not text:
        raise CronError("expression is empty")
    if text.startswith("@"):
        text = _expand_macro(text)
    fields = text.split()
    if len(fields) not in (5, 6):
        raise CronError(f"expected 5 or 6 fields, got {len(fields)}")
    if len(fields) == 5:
        fields.insert(0, "0")
    return _compile(fields)


def _expand_macro(text: str) -> str:
    expansion = _MACROS.get(text.lower())
    if expansion is None:
        raise CronError(f"unknown macro '{text}'")
    return expansion


def _compile(fields: list[str]) -> CronExpr:
    second, minute, hour, dom, month, dow = (
        _parse_field(spec, text) for spec, text in zip(_FIELDS, fields, strict=True)
    )
    hour_text, dom_text, dow_text = fields[2], fields[3], fields[5]
    return CronExpr(
        seconds=second,
        minutes=minute,
        hours=hour,
        days_of_month=dom,
        months=month,
        days_of_week=tuple(sorted({day % 7 for day in dow})),
        dom_restricted=not dom_text.startswith(_UNRESTRICTED_MARKS),
        dow_restricted=not dow_text.startswith(_UNRESTRICTED_MARKS),
        hour_is_wildcard="*" in hour_text or "/" in hour_text,
    )


def _parse_field(spec: _FieldSpec, text: str) -> tuple[int, ...]:
    _reject_unexpected_characters(spec, text)
    values: set[int] = set()
    for item in text.split(","):
        values.update(_parse_item(spec, item))
    return tuple(sorted(values))


def _reject_unexpected_characters(spec: _FieldSpec, text: str) -> None:
    for character in text:
        if character not in _ALLOWED_CHARACTERS:
            raise _field_error(spec, f"unexpected character {character!r} in {text!r}")


def _parse_item(spec: _FieldSpec, item: str) -> range:
    if not item:
        raise _field_error(spec, "empty list item")
    base, slash, step_text = item.partition("/")
    step = _parse_step(spec, item, step_text) if slash else 1
    if base in _UNRESTRICTED_MARKS:
        if base == "?" and not spec.accepts_question_mark:
            raise _field_error(spec, "'?' is only allowed in day-of-month and day-of-week")
        return range(spec.low, spec.natural_end + 1, step)
    if not base:
        raise _field_error(spec, f"'{item}' has no start before '/'")
    if "-" in base:
        first, last = _parse_range(spec, base)
    else:
        first = _parse_value(spec, base)
        # `a/n` runs to the end of the field; a lone value is just itself.
        last = max(first, spec.natural_end) if slash else first
    return range(first, last + 1, step)


def _parse_step(spec: _FieldSpec, item: str, text: str) -> int:
    if not text:
        raise _field_error(spec, f"'{item}' has no step after '/'")
    if "/" in text:
        raise _field_error(spec, f"'{item}' has more than one '/'")
    if text.startswith("-") and text[1:].isdigit():
        raise _field_error(spec, f"step {text} must be at least 1")
    if not text.isdigit():
        raise _field_error(spec, f"step '{text}' is not a number")
    significant = text.lstrip("0")
    if not significant:
        raise _field_error(spec, "step 0 must be at least 1")
    # A step longer than any field selects only the start, whatever its exact size.
    return int(significant) if len(significant) <= _MAX_DIGITS else 10**_MAX_DIGITS


def _parse_range(spec: _FieldSpec, text: str) -> tuple[int, int]:
    bounds = text.split("-")
    if len(bounds) != 2:
        raise _field_error(spec, f"'{text}' is not a valid range")
    start_text, end_text = bounds
    if not start_text or not end_text:
        raise _field_error(spec, f"range '{text}' is missing a bound")
    first = _parse_value(spec, start_text)
    last = _parse_value(spec, end_text)
    if spec is _DAY_OF_WEEK and last == 0 and first > 0 and not end_text.isdigit():
        # Lets `FRI-SUN` mean Friday to Sunday, as 7 is Sunday too.
        last = 7
    if first > last:
        raise _field_error(spec, f"range {text} is reversed")
    return first, last


def _parse_value(spec: _FieldSpec, text: str) -> int:
    if text.isdigit():
        significant = text.lstrip("0") or "0"
        if len(significant) > _MAX_DIGITS:
            raise _field_error(spec, f"{significant[:_MAX_DIGITS]}... is out of range")
        value = int(significant)
        if not spec.low <= value <= spec.high:
            raise _field_error(spec, f"{value} is out of range {spec.low}-{spec.high}")
        return value
    if spec.names:
        number = spec.names.get(text.upper())
        if number is None:
            raise _field_error(spec, f"unknown name '{text}'")
        return number
    raise _field_error(spec, f"'{text}' is not a number")


# --------------------------------------------------------------------------------------------
# The parsed form
# --------------------------------------------------------------------------------------------


def _next_allowed_table(allowed: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Entry v is the smallest allowed value >= v, or -1; entry `size` is a -1 sentinel."""
    table = [-1] * (size + 1)
    following = -1
    allowed_set = set(allowed)
    for value in range(size - 1, -1, -1):
        if value in allowed_set:
            following = value
        table[value] = following
    return tuple(table)


def _bits(values: tuple[int, ...]) -> int:
    mask = 0
    for value in values:
        mask |= 1 << value
    return mask


@dataclass(frozen=True, slots=True)
class CronExpr:
    """A parsed cron expression: the sorted allowed values of each field, and the flags that
    decide how days and daylight saving time are treated (see the module docstring)."""

    seconds: tuple[int, ...]
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days_of_month: tuple[int, ...]
    months: tuple[int, ...]
    days_of_week: tuple[int, ...]  # 0 = Sunday .. 6
    dom_restricted: bool
    dow_restricted: bool
    hour_is_wildcard: bool
    # Precomputed so that next_fire_ms never scans values one by one.
    _next_second: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _next_minute: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _next_hour: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _month_bits: int = field(init=False, repr=False, compare=False)
    # Indexed by the weekday (0 = Sunday) of the 1st: bit d set when day d of the month matches.
    _day_bits_by_first_weekday: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = (self.seconds, self.minutes, self.hours, self.days_of_month, self.months)
        if not all(fields) or not self.days_of_week:
            raise ValueError("every field of a CronExpr needs at least one value")
        object.__setattr__(self, "_next_second", _next_allowed_table(self.seconds, 60))
        object.__setattr__(self, "_next_minute", _next_allowed_table(self.minutes, 60))
        object.__setattr__(self, "_next_hour", _next_allowed_table(self.hours, 24))
        object.__setattr__(self, "_month_bits", _bits(self.months))
        day_bits = tuple(self._matching_day_bits(first) for first in range(7))
        object.__setattr__(self, "_day_bits_by_first_weekday", day_bits)

    def _matching_day_bits(self, first_weekday: int) -> int:
        dom_bits = _bits(self.days_of_month)
        weekdays = set(self.days_of_week)
        dow_bits = _bits(tuple(d for d in range(1, 32) if (first_weekday + d - 1) % 7 in weekdays))
        if self.dom_restricted and self.dow_restricted:
            return dom_bits | dow_bits
        # As in Vixie cron: an unrestricted field still filters by its own values (`*/2`).
        return dom_bits & dow_bits

    def first_time_at_or_after(self, second_of_day: int) -> int | None:
        """The earliest matching time of day (in seconds) at or after `second_of_day`."""
        hour, rest = divmod(second_of_day, 3600)
        minute, second = divmod(rest, 60)
        found_hour = self._next_hour[hour]
        if found_hour == hour:
            found_minute = self._next_minute[minute]
            if found_minute == minute:
                found_second = self._next_second[second]
                if found_second >= 0:
                    return second_of_day - second + found_second
                found_minute = self._next_minute[minute + 1]
            if found_minute >= 0:
                return hour * 3600 + found_minute * 60 + self.seconds[0]
            found_hour = self._next_hour[hour + 1]
        if found_hour < 0:
            return None
        return found_hour * 3600 + self.minutes[0] * 60 + self.seconds[0]


# --------------------------------------------------------------------------------------------
# Local days and their wall-time pieces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Piece:
    """Wall seconds [start, end) of one local day that map to instants with one `offset`."""

    start: int
    end: int
    offset: int
    first_instant: int
    end_instant: int


@dataclass(frozen=True, slots=True)
class _DayLayout:
    midnight: int  # local wall time of 00:00 in seconds since 1970-01-01 (wall clock)
    pieces: tuple[_Piece, ...]
    earliest_instant: int | None
    # No offset change from a day before to a day after: no later day can fire before this one.
    stable: bool


def _offset_at(tz: tzinfo, instant: int) -> int:
    delta = datetime.fromtimestamp(instant, tz).utcoffset()
    if delta is None:
        raise ValueError(f"time zone {tz!r} has no UTC offset")
    return delta.days * _DAY + delta.seconds


def _first_offset_change(tz: tzinfo, low: int, high: int, offset: int) -> int:
    """The first instant in (low, high] whose offset is not `offset`, given that low's is."""
    while high - low > 1:
        middle = (low + high) // 2
        if _offset_at(tz, middle) == offset:
            low = middle
        else:
            high = middle
    return high


def _constant_offset_spans(tz: tzinfo, start: int, end: int) -> list[tuple[int, int, int]]:
    """Split instants [start, end) into (start, end, offset) spans of constant UTC offset.

    Assumes offsets at the ends differ whenever a change happens in between, which holds for
    every zone whose transitions are more than a few days apart.
    """
    spans: list[tuple[int, int, int]] = []
    offset = _offset_at(tz, start)
    final_offset = _offset_at(tz, end)
    while offset != final_offset and len(spans) < 8:
        change = _first_offset_change(tz, start, end, offset)
        spans.append((start, change, offset))
        start, offset = change, _offset_at(tz, change)
    spans.append((start, end, offset))
    return spans


def _wall_range(
    spans: list[tuple[int, int, int]], index: int, hour_is_wildcard: bool
) -> tuple[int, int]:
    start, end, offset = spans[index]
    if hour_is_wildcard:
        return start + offset, end + offset
    # Fixed hours: a gap's wall times stay with the span before it (fired shifted forward),
    # and the span after a fold starts where the first pass ended (the repeat is skipped).
    before = spans[index - 1][2] if index > 0 else offset
    after = spans[index + 1][2] if index + 1 < len(spans) else offset
    return start + max(before, offset), end + max(offset, after)


@functools.lru_cache(maxsize=16_384)
def _day_layout(tz: tzinfo, ordinal: int, hour_is_wildcard: bool) -> _DayLayout:
    midnight = (ordinal - _EPOCH_ORDINAL) * _DAY
    # Every instant whose wall time falls on this day lies in this window (offsets < 1 day).
    spans = _constant_offset_spans(tz, midnight - _DAY, midnight + 2 * _DAY)
    pieces: list[_Piece] = []
    for index in range(len(spans)):
        wall_start, wall_end = _wall_range(spans, index, hour_is_wildcard)
        start, end = max(wall_start - midnight, 0), min(wall_end - midnight, _DAY)
        if start < end:
            offset = spans[index][2]
            instant = midnight - offset
            pieces.append(_Piece(start, end, offset, instant + start, instant + end))
    earliest = min((piece.first_instant for piece in pieces), default=None)
    return _DayLayout(midnight, tuple(pieces), earliest, stable=len(spans) == 1)


def _first_fire_on_day(cron: CronExpr, layout: _DayLayout, earliest: int) -> int | None:
    best: int | None = None
    for piece in layout.pieces:
        if piece.end_instant <= earliest:
            continue
        # Within a piece wall time and instant move together, so search by wall time.
        wall_floor = max(piece.start, earliest + piece.offset - layout.midnight)
        second_of_day = cron.first_time_at_or_after(wall_floor)
        if second_of_day is not None and second_of_day < piece.end:
            instant = layout.midnight + second_of_day - piece.offset
            if best is None or instant < best:
                best = instant
    return best


def _days_in_month(year: int, month: int) -> int:
    if month == 2 and calendar.isleap(year):
        return 29
    return _DAYS_IN_MONTH[month]


def _candidate_days(cron: CronExpr, first: int, last: int) -> Iterator[int]:
    """Ordinals in [first, last] whose month, day of month and day of week match."""
    start = date.fromordinal(first)
    year, month = start.year, start.month
    month_start = first - start.day + 1
    lowest_day = start.day
    while month_start <= last:
        length = _days_in_month(year, month)
        if cron._month_bits >> month & 1:
            # Ordinal 1 (0001-01-01) was a Monday, so ordinal % 7 counts weekdays from Sunday = 0.
            bits = cron._day_bits_by_first_weekday[month_start % 7]
            bits &= ((1 << (length + 1)) - 1) & (-1 << lowest_day)
            while bits:
                lowest_bit = bits & -bits
                ordinal = month_start + lowest_bit.bit_length() - 2
                if ordinal > last:
                    return
                yield ordinal
                bits ^= lowest_bit
        month_start += length
        lowest_day = 1
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)


def _horizon_ordinal(ordinal: int) -> int:
    day = date.fromordinal(ordinal)
    year = day.year + SEARCH_HORIZON_YEARS
    if year > date.max.year:
        return _MAX_ORDINAL
    return min(
        date(year, day.month, min(day.day, _days_in_month(year, day.month))).toordinal(),
        _MAX_ORDINAL,
    )


def _local_ordinal(tz: tzinfo, instant: int) -> int:
    try:
        return datetime.fromtimestamp(instant, tz).toordinal()
    except (OverflowError, ValueError, OSError) as exc:
        raise ValueError(f"instant {instant} s is outside the supported years 1-9999") from exc


# --------------------------------------------------------------------------------------------
# Public search functions
# --------------------------------------------------------------------------------------------


def next_fire_ms(cron: CronExpr, tz: tzinfo, after_ms: int) -> int | None:
    """The first fire instant strictly after `after_ms` (epoch ms, whole seconds), or None when
    nothing fires within SEARCH_HORIZON_YEARS."""
    earliest = after_ms // 1000 + 1
    today = _local_ordinal(tz, earliest)
    # A fall-back can bring the wall clock back to yesterday, so yesterday may still fire.
    first = max(today - 1, _MIN_ORDINAL)
    last = _horizon_ordinal(today)
    best: int | None = None
    for ordinal in _candidate_days(cron, first, last):
        layout = _day_layout(tz, ordinal, cron.hour_is_wildcard)
        if layout.earliest_instant is None:
            continue  # the whole day fell into a gap
        if best is not None and layout.earliest_instant >= best:
            break
        found = _first_fire_on_day(cron, layout, earliest)
        if found is None:
            continue
        if best is None or found < best:
            best = found
        if layout.stable:
            break
    return None if best is None else best * 1000


def fires_between(
    cron: CronExpr, tz: tzinfo, after_ms: int, until_ms: int, limit: int
) -> list[int]:
    """Successive fires in (after_ms, until_ms], at most `limit` of them."""
    fires: list[int] = []
    cursor = after_ms
    while len(fires) < limit:
        fire = next_fire_ms(cron, tz, cursor)
        if fire is None or fire > until_ms:
            break
        fires.append(fire)
        cursor = fire
    return fires
