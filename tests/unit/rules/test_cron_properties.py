"""Property tests for shared.rules.cron: generated expressions, instants 2000-2090, zones."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, timezone, tzinfo
from zoneinfo import ZoneInfo

from croniter import croniter
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shared.rules.cron import CronError, CronExpr, next_fire_ms, parse

SETTINGS = settings(max_examples=200, deadline=None)

DST_ZONE_NAMES = (
    "Europe/Berlin",
    "America/New_York",
    "Australia/Sydney",
    "Australia/Lord_Howe",
    "America/Santiago",
    "America/Havana",
    "Asia/Tehran",
    "Pacific/Chatham",
    "Pacific/Apia",
    "America/St_Johns",
)
ZONES: tuple[tzinfo, ...] = (
    UTC,
    ZoneInfo("Asia/Kolkata"),
    *(ZoneInfo(name) for name in DST_ZONE_NAMES),
)
FIXED_OFFSET_ZONES: tuple[tzinfo, ...] = (
    UTC,
    timezone(timedelta(hours=5, minutes=30)),
    timezone(timedelta(hours=-9, minutes=-30)),
    timezone(timedelta(hours=14)),
    timezone(timedelta(hours=-12)),
)

START_MS = int(datetime(2000, 1, 1, tzinfo=UTC).timestamp()) * 1000
END_MS = int(datetime(2090, 1, 1, tzinfo=UTC).timestamp()) * 1000
instants_ms = st.integers(min_value=START_MS, max_value=END_MS)


# ---------------------------------------------------------------------------------------------
# A strategy for valid expressions, straight from the grammar
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldGrammar:
    low: int
    high: int
    names: tuple[str, ...] = ()  # names[i] is the name of value low + i
    question_mark: bool = False


SECOND = FieldGrammar(0, 59)
MINUTE = FieldGrammar(0, 59)
HOUR = FieldGrammar(0, 23)
DAY_OF_MONTH = FieldGrammar(1, 31, question_mark=True)
MONTH = FieldGrammar(
    1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
)
DAY_OF_WEEK = FieldGrammar(
    0, 7, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"), question_mark=True
)


@st.composite
def values(draw: st.DrawFn, grammar: FieldGrammar, high: int | None = None) -> str:
    top = grammar.high if high is None else high
    value = draw(st.integers(grammar.low, top))
    index = value - grammar.low
    if index < len(grammar.names) and draw(st.booleans()):
        name = grammar.names[index]
        return draw(st.sampled_from((name, name.lower(), name.title())))
    return str(value)


@st.composite
def items(draw: st.DrawFn, grammar: FieldGrammar) -> str:
    span = grammar.high - grammar.low + 1
    kind = draw(st.sampled_from(("any", "value", "range", "any_step", "range_step", "from_step")))
    step = draw(st.integers(1, span))
    if kind == "any":
        return draw(st.sampled_from(("*", "?") if grammar.question_mark else ("*",)))
    if kind == "value":
        return draw(values(grammar))
    if kind == "any_step":
        return f"*/{step}"
    if kind == "from_step":
        # croniter reads `7/n` in day-of-week its own way, so those starts stop at Saturday.
        start_high = 6 if grammar is DAY_OF_WEEK else grammar.high
        return f"{draw(values(grammar, high=start_high))}/{step}"
    # No `a-a` ranges: croniter reads them as `*` (the unit tests cover them instead).
    first = draw(st.integers(grammar.low, grammar.high - 1))
    last = draw(st.integers(first + 1, grammar.high))
    start, end = draw(range_bounds(grammar, first)), draw(range_bounds(grammar, last, first))
    text = f"{start}-{end}"
    return f"{text}/{step}" if kind == "range_step" else text


def range_bounds(
    grammar: FieldGrammar, value: int, start: int | None = None
) -> st.SearchStrategy[str]:
    """A bound as a number or a name; a closing 7 after a start above 0 may be written SUN."""
    index = value - grammar.low
    choices = [str(value)]
    if index < len(grammar.names):
        choices.append(grammar.names[index])
    if grammar is DAY_OF_WEEK and value == 7 and start:
        choices.append("SUN")
    return st.sampled_from(choices)


def field_texts(grammar: FieldGrammar) -> st.SearchStrategy[str]:
    return st.lists(items(grammar), min_size=1, max_size=3).map(",".join)


@dataclass(frozen=True)
class Generated:
    text: str
    fields: tuple[str, ...]  # always six: the seconds first

    @property
    def dom(self) -> str:
        return self.fields[3]

    @property
    def dow(self) -> str:
        return self.fields[5]


@st.composite
def expressions(draw: st.DrawFn, seconds: st.SearchStrategy[str] | None = None) -> Generated:
    second = draw(seconds if seconds is not None else field_texts(SECOND))
    rest = tuple(
        draw(field_texts(grammar)) for grammar in (MINUTE, HOUR, DAY_OF_MONTH, MONTH, DAY_OF_WEEK)
    )
    six = draw(st.booleans()) or second != "0"
    parts = (second, *rest) if six else rest
    gaps = draw(st.lists(st.sampled_from((" ", "  ", "\t")), min_size=len(parts) + 1))
    text = gaps[0] + "".join(part + gap for part, gap in zip(parts, gaps[1:], strict=False))
    return Generated(text, (second, *rest))


def croniter_agrees_on_days(generated: Generated) -> bool:
    """Whether croniter reads the day fields as Vixie cron does.

    Vixie cron calls a day field unrestricted whenever it starts with `*`, and then requires
    both fields to match; croniter looks at the expanded values instead, so a field like `*/2`
    or `1,*` against anything but a plain `*` is read differently. croniter also refuses `?`
    inside a list.
    """
    plain = ("*", "?")
    dom, dow = generated.dom, generated.dow
    if any("?" in text and text not in plain for text in (dom, dow)):
        return False
    mixes_star = any("*" in text and text not in plain for text in (dom, dow))
    return not mixes_star or dom in plain or dow in plain


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def wall_time(instant_ms: int, tz: tzinfo) -> datetime:
    return datetime.fromtimestamp(instant_ms // 1000, tz).replace(tzinfo=None)


def offset_seconds(tz: tzinfo, instant_s: int) -> int:
    delta = datetime.fromtimestamp(instant_s, tz).utcoffset()
    assert delta is not None
    return int(delta.total_seconds())


def day_matches(cron: CronExpr, day: date) -> bool:
    if day.month not in cron.months:
        return False
    in_dom = day.day in cron.days_of_month
    in_dow = (day.weekday() + 1) % 7 in cron.days_of_week
    if cron.dom_restricted and cron.dow_restricted:
        return in_dom or in_dow
    return in_dom and in_dow


def wall_matches(cron: CronExpr, wall: datetime) -> bool:
    return (
        wall.second in cron.seconds
        and wall.minute in cron.minutes
        and wall.hour in cron.hours
        and day_matches(cron, wall.date())
    )


def successive(cron: CronExpr, tz: tzinfo, after_ms: int, count: int) -> Iterator[int]:
    cursor: int | None = after_ms
    for _ in range(count):
        assert cursor is not None
        cursor = next_fire_ms(cron, tz, cursor)
        if cursor is None:
            return
        yield cursor


# ---------------------------------------------------------------------------------------------
# Basic properties in every zone
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(expressions(), st.sampled_from(ZONES), instants_ms)
def test_fires_are_whole_seconds_strictly_after_and_increasing(
    generated: Generated, tz: tzinfo, after_ms: int
) -> None:
    cron = parse(generated.text)
    previous = after_ms
    for fire in successive(cron, tz, after_ms, 5):
        assert fire % 1000 == 0
        assert fire > previous
        previous = fire


@SETTINGS
@given(expressions(), st.sampled_from(ZONES), instants_ms, st.data())
def test_every_instant_before_a_fire_leads_to_that_fire(
    generated: Generated, tz: tzinfo, after_ms: int, data: st.DataObject
) -> None:
    cron = parse(generated.text)
    fire = next_fire_ms(cron, tz, after_ms)
    assume(fire is not None)
    assert fire is not None
    assert next_fire_ms(cron, tz, fire - 1) == fire
    for _ in range(3):
        probe = data.draw(st.integers(after_ms, fire - 1))
        assert next_fire_ms(cron, tz, probe) == fire


@SETTINGS
@given(expressions(), st.sampled_from(ZONES), instants_ms)
def test_fire_wall_time_matches_the_fields(generated: Generated, tz: tzinfo, after_ms: int) -> None:
    cron = parse(generated.text)
    for fire in successive(cron, tz, after_ms, 3):
        wall = wall_time(fire, tz)
        if wall_matches(cron, wall):
            continue
        # Only a fixed-hour time skipped by a gap may fire elsewhere: shifted by the gap.
        assert not cron.hour_is_wildcard
        instant = fire // 1000
        gap = offset_seconds(tz, instant) - offset_seconds(tz, instant - 86_400)
        assert gap > 0
        assert wall_matches(cron, wall - timedelta(seconds=gap))


@SETTINGS
@given(expressions(), st.sampled_from(FIXED_OFFSET_ZONES), instants_ms)
def test_agrees_with_croniter_in_fixed_offset_zones(
    generated: Generated, tz: tzinfo, after_ms: int
) -> None:
    assume(croniter_agrees_on_days(generated))
    cron = parse(generated.text)
    fire = next_fire_ms(cron, tz, after_ms)
    assume(fire is not None)  # croniter gives up on specs that never fire
    assert fire is not None
    start = datetime.fromtimestamp(after_ms / 1000, tz)
    expected = croniter(generated.text, start, second_at_beginning=True, day_or=True).get_next(
        datetime
    )
    assert fire == int(expected.timestamp()) * 1000


@SETTINGS
@given(st.text())
def test_parse_raises_only_cron_error_on_any_text(text: str) -> None:
    try:
        parse(text)
    except CronError as error:
        assert error.reason


@SETTINGS
@given(st.text(alphabet="0123456789*/,-?@ \tabcdefghijklmnopqrstuvwxyzJANFEBMONSUN", max_size=40))
def test_parse_raises_only_cron_error_on_cron_like_text(text: str) -> None:
    try:
        parse(text)
    except CronError as error:
        assert error.reason


# ---------------------------------------------------------------------------------------------
# Around real offset changes: compare with a brute-force model built on PEP 495 folds
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def offset_changes(tz: tzinfo, year: int) -> tuple[int, ...]:
    """For each offset change in `year`, an instant (s) at most 6 hours after it."""
    start = int(datetime(year, 1, 1, tzinfo=UTC).timestamp())
    step = 6 * 3600
    changes = []
    previous = offset_seconds(tz, start)
    for instant in range(start + step, start + 366 * 86_400, step):
        current = offset_seconds(tz, instant)
        if current != previous:
            changes.append(instant)
        previous = current
    return tuple(changes)


def model_fires(cron: CronExpr, tz: tzinfo, first_day: date, last_day: date) -> list[int]:
    """Every fire (s) of the wall times on the given local days, from the rules stated plainly:
    fixed hours fire at PEP 495 fold=0; wildcard hours at every real instant with that wall."""
    fires: set[int] = set()
    day = first_day
    while day <= last_day:
        if day_matches(cron, day):
            for hour, minute, second in itertools.product(cron.hours, cron.minutes, cron.seconds):
                wall = datetime(day.year, day.month, day.day, hour, minute, second)
                fires.update(instants_for_wall(cron, tz, wall))
        day += timedelta(days=1)
    return sorted(fires)


def instants_for_wall(cron: CronExpr, tz: tzinfo, wall: datetime) -> Iterator[int]:
    if not cron.hour_is_wildcard:
        yield int(wall.replace(tzinfo=tz, fold=0).timestamp())
        return
    for fold in (0, 1):
        instant = int(wall.replace(tzinfo=tz, fold=fold).timestamp())
        if datetime.fromtimestamp(instant, tz).replace(tzinfo=None) == wall:  # not in a gap
            yield instant


small_seconds = st.sampled_from(("0", "0", "30", "15,45", "59"))
small_minutes = st.sampled_from(("0", "30", "0,30", "*/15", "45", "10-12", "59", "*/20"))


@st.composite
def near_offset_changes(draw: st.DrawFn) -> tuple[tzinfo, int]:
    tz = ZoneInfo(draw(st.sampled_from(DST_ZONE_NAMES)))
    changes = offset_changes(tz, draw(st.integers(2000, 2089)))
    assume(changes)
    after_s = draw(st.sampled_from(changes)) + draw(st.integers(-40 * 3600, 40 * 3600))
    return tz, after_s * 1000 + draw(st.integers(0, 999))


@st.composite
def modelled_expressions(draw: st.DrawFn) -> str:
    """Any hour and day fields, but few seconds and minutes so the model stays cheap."""
    generated = draw(expressions(seconds=small_seconds))
    minute = draw(small_minutes)
    fields = (generated.fields[0], minute, *generated.fields[2:])
    return " ".join(fields)


@settings(max_examples=300, deadline=None)
@given(modelled_expressions(), near_offset_changes())
def test_matches_the_model_around_offset_changes(
    text: str, zone_and_after: tuple[tzinfo, int]
) -> None:
    tz, after_ms = zone_and_after
    cron = parse(text)
    after_day = wall_time(after_ms, tz).date()
    fires = model_fires(cron, tz, after_day - timedelta(days=2), after_day + timedelta(days=3))
    # The model is complete for instants up to two days after `after`.
    complete_until = after_ms // 1000 + 2 * 86_400
    expected = next((fire for fire in fires if fire * 1000 > after_ms), None)
    actual = next_fire_ms(cron, tz, after_ms)
    if expected is not None and expected <= complete_until:
        assert actual == expected * 1000
    else:
        assert actual is None or actual // 1000 > complete_until
