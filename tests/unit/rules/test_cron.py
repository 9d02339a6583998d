"""Table tests for shared.rules.cron: parsing, errors, and next fires in UTC and across DST changes.

Every expected instant below was worked out from the zone's offsets by hand and cross-checked
against a PEP 495 brute-force model; they are written as literals on purpose.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, tzinfo
from zoneinfo import ZoneInfo

import pytest

from shared.rules.cron import (
    SEARCH_HORIZON_YEARS,
    CronError,
    CronExpr,
    fires_between,
    next_fire_ms,
    parse,
)

ALL_SECONDS = tuple(range(60))
ALL_HOURS = tuple(range(24))
ALL_DAYS = tuple(range(1, 32))
ALL_MONTHS = tuple(range(1, 13))
ALL_WEEKDAYS = tuple(range(7))


def ms(iso: str) -> int:
    """Epoch ms of an ISO instant such as 2027-01-01T00:00:00Z or ...T00:00:04.999Z."""
    moment = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return round(moment.timestamp() * 1000)


def iso(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def zone(name: str) -> tzinfo:
    return UTC if name == "UTC" else ZoneInfo(name)


def field_values(cron: CronExpr) -> tuple[tuple[int, ...], ...]:
    return (
        cron.seconds,
        cron.minutes,
        cron.hours,
        cron.days_of_month,
        cron.months,
        cron.days_of_week,
    )


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("* * * * *", ((0,), ALL_SECONDS, ALL_HOURS, ALL_DAYS, ALL_MONTHS, ALL_WEEKDAYS)),
        ("5 4 3 2 1", ((0,), (5,), (4,), (3,), (2,), (1,))),
        ("05 04 03 02 01", ((0,), (5,), (4,), (3,), (2,), (1,))),
        ("1-5 * * * *", ((0,), (1, 2, 3, 4, 5), ALL_HOURS, ALL_DAYS, ALL_MONTHS, ALL_WEEKDAYS)),
        ("*/15 0 1 1 0", ((0,), (0, 15, 30, 45), (0,), (1,), (1,), (0,))),
        ("10-30/10 0 1 1 0", ((0,), (10, 20, 30), (0,), (1,), (1,), (0,))),
        ("50/5 0 1 1 0", ((0,), (50, 55), (0,), (1,), (1,), (0,))),
        ("1,2,3-4,*/30 0 1 1 0", ((0,), (0, 1, 2, 3, 4, 30), (0,), (1,), (1,), (0,))),
        ("0 0 ? * ?", ((0,), (0,), (0,), ALL_DAYS, ALL_MONTHS, ALL_WEEKDAYS)),
        ("0 0 1-31/10 * *", ((0,), (0,), (0,), (1, 11, 21, 31), ALL_MONTHS, ALL_WEEKDAYS)),
        ("0 0 1 JAN,mar-May 0", ((0,), (0,), (0,), (1,), (1, 3, 4, 5), (0,))),
        ("0 0 1 2/5 0", ((0,), (0,), (0,), (1,), (2, 7, 12), (0,))),
        ("0 0 1 1 MON-FRI", ((0,), (0,), (0,), (1,), (1,), (1, 2, 3, 4, 5))),
        ("0 0 1 1 sun,Sat", ((0,), (0,), (0,), (1,), (1,), (0, 6))),
        ("0 0 1 1 7", ((0,), (0,), (0,), (1,), (1,), (0,))),
        ("0 0 1 1 5-7", ((0,), (0,), (0,), (1,), (1,), (0, 5, 6))),
        ("0 0 1 1 FRI-SUN", ((0,), (0,), (0,), (1,), (1,), (0, 5, 6))),
        ("0 0 1 1 1-7/2", ((0,), (0,), (0,), (1,), (1,), (0, 1, 3, 5))),
        ("0 0 1 1 */3", ((0,), (0,), (0,), (1,), (1,), (0, 3, 6))),
        ("0 0 1 1 3/2", ((0,), (0,), (0,), (1,), (1,), (3, 5))),
        ("0 0 1 1 5-5", ((0,), (0,), (0,), (1,), (1,), (5,))),
        ("15,45 */20 9-11 1 1 0", ((15, 45), (0, 20, 40), (9, 10, 11), (1,), (1,), (0,))),
        ("59 59 23 31 12 6", ((59,), (59,), (23,), (31,), (12,), (6,))),
        ("  0\t0   1  1 \t 0  ", ((0,), (0,), (0,), (1,), (1,), (0,))),
    ],
)
def test_parse_field_values(expr: str, expected: tuple[tuple[int, ...], ...]) -> None:
    assert field_values(parse(expr)) == expected


@pytest.mark.parametrize(
    ("expr", "dom_restricted", "dow_restricted", "hour_is_wildcard"),
    [
        ("* * * * *", False, False, True),
        ("0 9 * * *", False, False, False),
        ("0 9-17 * * *", False, False, False),
        ("0 9,17 1 * MON", True, True, False),
        ("0 */2 */2 * *", False, False, True),
        ("0 1-23/2 ? * 1", False, True, True),
        ("0 6/6 1,* * *", True, False, True),
        ("0 *,5 * * ?", False, False, True),
        ("0 0 0 1-31 * 0-7", True, True, False),
    ],
)
def test_parse_flags(
    expr: str, dom_restricted: bool, dow_restricted: bool, hour_is_wildcard: bool
) -> None:
    cron = parse(expr)
    assert cron.dom_restricted is dom_restricted
    assert cron.dow_restricted is dow_restricted
    assert cron.hour_is_wildcard is hour_is_wildcard


@pytest.mark.parametrize(
    ("macro", "equivalent"),
    [
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        ("@monthly", "0 0 1 * *"),
        ("@weekly", "0 0 * * 0"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        ("  @Daily ", "0 0 * * *"),
    ],
)
def test_macros_expand_like_vixie_cron(macro: str, equivalent: str) -> None:
    assert parse(macro) == parse(equivalent)


def test_five_fields_mean_second_zero() -> None:
    assert parse("*/10 * * * *") == parse("0 */10 * * * *")


def test_seven_and_zero_are_both_sunday() -> None:
    assert parse("0 0 * * 7") == parse("0 0 * * 0") == parse("0 0 * * SUN")


def test_parse_is_cached() -> None:
    assert parse("0 12 * * MON") is parse("0 12 * * MON")


def test_parsed_expression_is_frozen() -> None:
    cron = parse("0 12 * * *")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cron.hours = (1,)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Parse errors: one short sentence naming the field
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        pytest.param("", "expression is empty", id="empty"),
        pytest.param(" \t ", "expression is empty", id="blank"),
        pytest.param("* * * *", "expected 5 or 6 fields, got 4", id="too-few-fields"),
        pytest.param("* * * * * * *", "expected 5 or 6 fields, got 7", id="too-many-fields"),
        pytest.param("@reboot", "unknown macro '@reboot'", id="unknown-macro"),
        pytest.param("@daily 5", "unknown macro '@daily 5'", id="macro-with-fields"),
        pytest.param("60 * * * * *", "second: 60 is out of range 0-59", id="second-range"),
        pytest.param("60 * * * *", "minute: 60 is out of range 0-59", id="minute-range"),
        pytest.param("0 25 * * *", "hour: 25 is out of range 0-23", id="hour-range"),
        pytest.param("0 0 0 * *", "day-of-month: 0 is out of range 1-31", id="dom-low"),
        pytest.param("0 0 32 * *", "day-of-month: 32 is out of range 1-31", id="dom-high"),
        pytest.param("0 0 * 13 *", "month: 13 is out of range 1-12", id="month-range"),
        pytest.param("0 0 * * 8", "day-of-week: 8 is out of range 0-7", id="dow-range"),
        pytest.param("0 0-24 * * *", "hour: 24 is out of range 0-23", id="range-bound"),
        pytest.param("9999999 * * * *", "minute: 999999... is out of range", id="huge-number"),
        pytest.param("0 0 20-10 * *", "day-of-month: range 20-10 is reversed", id="reversed-range"),
        pytest.param(
            "0 0 * * FRI-MON", "day-of-week: range FRI-MON is reversed", id="reversed-names"
        ),
        pytest.param("*/0 * * * *", "minute: step 0 must be at least 1", id="zero-step"),
        pytest.param("*/-2 * * * *", "minute: step -2 must be at least 1", id="negative-step"),
        pytest.param("*/x * * * *", "minute: step 'x' is not a number", id="word-step"),
        pytest.param("0 */ * * *", "hour: '*/' has no step after '/'", id="missing-step"),
        pytest.param("*/5/2 * * * *", "minute: '*/5/2' has more than one '/'", id="two-steps"),
        pytest.param("/5 * * * *", "minute: '/5' has no start before '/'", id="missing-start"),
        pytest.param("0 0 * * FOO", "day-of-week: unknown name 'FOO'", id="unknown-day"),
        pytest.param("0 0 * JANUARY *", "month: unknown name 'JANUARY'", id="unknown-month"),
        pytest.param("MON * * * *", "minute: 'MON' is not a number", id="name-in-minute"),
        pytest.param("0 0 L * *", "day-of-month: 'L' is not a number", id="quartz-last"),
        pytest.param("0 0 15W * *", "day-of-month: '15W' is not a number", id="quartz-weekday"),
        pytest.param("1,,2 * * * *", "minute: empty list item", id="empty-item"),
        pytest.param("0 1, * * *", "hour: empty list item", id="trailing-comma"),
        pytest.param(
            "0 0 * * 5#3",
            "day-of-week: unexpected character '#' in '5#3'",
            id="garbage-character",
        ),
        pytest.param(
            "0 \u0663 * * *",
            "hour: unexpected character '\u0663' in '\u0663'",
            id="non-ascii-digit",
        ),
        pytest.param(
            "? * * * *",
            "minute: '?' is only allowed in day-of-month and day-of-week",
            id="question-mark",
        ),
        pytest.param("-5 * * * *", "minute: range '-5' is missing a bound", id="half-range"),
        pytest.param("1-2-3 * * * *", "minute: '1-2-3' is not a valid range", id="long-range"),
    ],
)
def test_parse_errors(expr: str, reason: str) -> None:
    with pytest.raises(CronError) as raised:
        parse(expr)
    assert raised.value.reason == reason
    assert str(raised.value) == reason


def test_cron_error_is_a_value_error() -> None:
    assert issubclass(CronError, ValueError)


# ---------------------------------------------------------------------------------------------
# Next fire in UTC and fixed-offset zones
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        ("* * * * *", "2027-01-01T00:00:00Z", "2027-01-01T00:01:00Z"),
        ("* * * * *", "2027-01-01T00:00:59.999Z", "2027-01-01T00:01:00Z"),
        ("*/5 * * * * *", "2027-01-01T00:00:00Z", "2027-01-01T00:00:05Z"),
        ("*/5 * * * * *", "2027-01-01T00:00:04.999Z", "2027-01-01T00:00:05Z"),
        ("*/5 * * * * *", "2027-01-01T00:00:05Z", "2027-01-01T00:00:10Z"),
        ("*/5 * * * * *", "2027-01-01T23:59:55Z", "2027-01-02T00:00:00Z"),
        ("0,30 * * * * *", "2027-01-01T00:00:29Z", "2027-01-01T00:00:30Z"),
        ("15,45 10 * * * *", "2027-01-01T00:10:45Z", "2027-01-01T01:10:15Z"),
        ("0 0 0 * * *", "2027-01-01T23:59:59.999Z", "2027-01-02T00:00:00Z"),
        ("59 59 23 31 12 *", "2027-06-01T00:00:00Z", "2027-12-31T23:59:59Z"),
        ("0 0 1 1 *", "2027-12-31T23:59:59Z", "2028-01-01T00:00:00Z"),
        ("@hourly", "2027-01-01T10:59:59.999Z", "2027-01-01T11:00:00Z"),
        ("@weekly", "2027-01-01T00:00:00Z", "2027-01-03T00:00:00Z"),
        ("@monthly", "2027-01-01T00:00:00Z", "2027-02-01T00:00:00Z"),
        ("30 8-10/2 * * *", "2027-01-01T08:30:00Z", "2027-01-01T10:30:00Z"),
        # 2027-01-01 is a Friday.
        ("0 9 * * MON-FRI", "2027-01-01T09:00:00Z", "2027-01-04T09:00:00Z"),
        ("0 12 * * 7", "2027-01-01T00:00:00Z", "2027-01-03T12:00:00Z"),
        # Both day fields restricted: the 13th OR any Friday.
        ("0 0 13 * FRI", "2027-01-01T00:00:00Z", "2027-01-08T00:00:00Z"),
        ("0 0 13 * FRI", "2027-01-09T00:00:00Z", "2027-01-13T00:00:00Z"),
        # Only one restricted: the other is `*` and does not widen anything.
        ("0 0 13 * *", "2027-01-01T00:00:00Z", "2027-01-13T00:00:00Z"),
        ("0 0 ? * MON", "2027-01-01T00:00:00Z", "2027-01-04T00:00:00Z"),
        # `*/2` is unrestricted (starts with `*`), so as in Vixie cron both must match:
        # Mondays that fall on odd days (Jan 4 is even, Jan 11 odd).
        ("0 0 */2 * MON", "2027-01-01T00:00:00Z", "2027-01-11T00:00:00Z"),
        ("0 0 31 * *", "2027-02-01T00:00:00Z", "2027-03-31T00:00:00Z"),
        ("0 0 29 2 *", "2027-03-01T00:00:00Z", "2028-02-29T00:00:00Z"),
        ("0 0 29 2 *", "2028-02-29T00:00:00Z", "2032-02-29T00:00:00Z"),
        # 2100 is not a leap year: eight years to the next February 29.
        ("0 0 29 2 *", "2096-03-01T00:00:00Z", "2104-02-29T00:00:00Z"),
        ("0 0 30 2 *", "2027-01-01T00:00:00Z", None),
        ("0 0 31 4,6,9,11 *", "2027-01-01T00:00:00Z", None),
        ("0 0 1 1 *", "9999-06-01T00:00:00Z", None),
    ],
)
def test_next_fire_in_utc(expr: str, after: str, expected: str | None) -> None:
    fire = next_fire_ms(parse(expr), UTC, ms(after))
    assert (None if fire is None else iso(fire)) == expected


@pytest.mark.parametrize(
    ("zone_name", "expr", "after", "expected"),
    [
        ("Asia/Kolkata", "0 9 * * *", "2027-01-01T00:00:00Z", "2027-01-01T03:30:00Z"),
        ("Asia/Kolkata", "0 0 1 1 *", "2026-12-31T18:30:00Z", "2027-12-31T18:30:00Z"),
        ("Asia/Kolkata", "*/15 * * * *", "2027-01-01T00:00:00Z", "2027-01-01T00:15:00Z"),
    ],
)
def test_next_fire_in_fixed_offset_zone(
    zone_name: str, expr: str, after: str, expected: str
) -> None:
    fire = next_fire_ms(parse(expr), zone(zone_name), ms(after))
    assert fire is not None
    assert iso(fire) == expected


def test_horizon_is_ten_years() -> None:
    assert SEARCH_HORIZON_YEARS == 10


def test_instant_outside_supported_years_is_rejected() -> None:
    with pytest.raises(ValueError, match="outside the supported years"):
        next_fire_ms(parse("* * * * *"), UTC, 10**18)


# ---------------------------------------------------------------------------------------------
# Daylight saving time
# ---------------------------------------------------------------------------------------------
#
# Transitions used (UTC instant: local before -> local after):
#   Europe/Berlin       2027-03-28T01:00Z 02:00 CET   -> 03:00 CEST   (gap 02:00-03:00)
#                       2027-10-31T01:00Z 03:00 CEST  -> 02:00 CET    (repeat 02:00-03:00)
#   America/New_York    2027-03-14T07:00Z 02:00 EST   -> 03:00 EDT    (gap 02:00-03:00)
#                       2027-11-07T06:00Z 02:00 EDT   -> 01:00 EST    (repeat 01:00-02:00)
#   Australia/Sydney    2027-04-03T16:00Z 03:00 AEDT  -> 02:00 AEST   (repeat 02:00-03:00)
#                       2027-10-02T16:00Z 02:00 AEST  -> 03:00 AEDT   (gap 02:00-03:00)
#   Australia/Lord_Howe 2027-04-03T15:00Z 02:00 +11   -> 01:30 +10:30 (repeat 01:30-02:00)
#                       2027-10-02T15:30Z 02:00 +10:30 -> 02:30 +11   (gap 02:00-02:30)
#   America/Santiago    2027-04-04T03:00Z Sun 00:00 -03 -> Sat 23:00 -04 (repeat Sat 23:00-24:00)
#                       2027-09-05T04:00Z Sun 00:00 -04 -> Sun 01:00 -03 (gap Sun 00:00-01:00)
#   Pacific/Apia        2011-12-30T10:00Z Dec 30 00:00 -10 -> Dec 31 00:00 +14 (the whole day);
#                       +14 again in December 2012

DST_CASES = [
    # Europe/Berlin
    pytest.param(
        "Europe/Berlin",
        "30 2 * * *",
        "2027-03-28T00:00:00Z",
        ["2027-03-28T01:30:00Z", "2027-03-29T00:30:00Z"],
        id="berlin-fixed-in-gap-shifts-to-0330-cest",
    ),
    pytest.param(
        "Europe/Berlin",
        "30 2,3 * * *",
        "2027-03-28T00:00:00Z",
        ["2027-03-28T01:30:00Z", "2027-03-29T00:30:00Z"],
        id="berlin-shifted-fire-coinciding-with-0330-fires-once",
    ),
    pytest.param(
        "Europe/Berlin",
        "30 2 * * *",
        "2027-10-30T23:00:00Z",
        ["2027-10-31T00:30:00Z", "2027-11-01T01:30:00Z"],
        id="berlin-fixed-in-repeat-fires-first-only",
    ),
    pytest.param(
        "Europe/Berlin",
        "0 * * * *",
        "2027-03-27T23:30:00Z",
        ["2027-03-28T00:00:00Z", "2027-03-28T01:00:00Z", "2027-03-28T02:00:00Z"],
        id="berlin-wildcard-across-gap",
    ),
    pytest.param(
        "Europe/Berlin",
        "0 * * * *",
        "2027-10-30T23:30:00Z",
        ["2027-10-31T00:00:00Z", "2027-10-31T01:00:00Z", "2027-10-31T02:00:00Z"],
        id="berlin-wildcard-fires-both-repeats",
    ),
    pytest.param(
        "Europe/Berlin",
        "30 2/12 * * *",
        "2027-03-28T00:00:00Z",
        ["2027-03-28T12:30:00Z", "2027-03-29T00:30:00Z"],
        id="berlin-stepped-hour-skips-the-gap",
    ),
    pytest.param(
        "Europe/Berlin",
        "30 2/12 * * *",
        "2027-10-30T23:00:00Z",
        ["2027-10-31T00:30:00Z", "2027-10-31T01:30:00Z", "2027-10-31T13:30:00Z"],
        id="berlin-stepped-hour-fires-both-repeats",
    ),
    # America/New_York
    pytest.param(
        "America/New_York",
        "30 2 * * *",
        "2027-03-14T05:00:00Z",
        ["2027-03-14T07:30:00Z", "2027-03-15T06:30:00Z"],
        id="new-york-fixed-in-gap-shifts-to-0330-edt",
    ),
    pytest.param(
        "America/New_York",
        "30 1 * * *",
        "2027-11-07T04:00:00Z",
        ["2027-11-07T05:30:00Z", "2027-11-08T06:30:00Z"],
        id="new-york-fixed-in-repeat-fires-first-only",
    ),
    pytest.param(
        "America/New_York",
        "0 * * * *",
        "2027-03-14T05:30:00Z",
        ["2027-03-14T06:00:00Z", "2027-03-14T07:00:00Z", "2027-03-14T08:00:00Z"],
        id="new-york-wildcard-across-gap",
    ),
    pytest.param(
        "America/New_York",
        "0 * * * *",
        "2027-11-07T04:30:00Z",
        ["2027-11-07T05:00:00Z", "2027-11-07T06:00:00Z", "2027-11-07T07:00:00Z"],
        id="new-york-wildcard-fires-both-repeats",
    ),
    # Australia/Sydney (southern hemisphere: back in April, forward in October)
    pytest.param(
        "Australia/Sydney",
        "30 2 * * *",
        "2027-10-02T12:00:00Z",
        ["2027-10-02T16:30:00Z", "2027-10-03T15:30:00Z"],
        id="sydney-fixed-in-gap-shifts-to-0330-aedt",
    ),
    pytest.param(
        "Australia/Sydney",
        "30 2 * * *",
        "2027-04-03T12:00:00Z",
        ["2027-04-03T15:30:00Z", "2027-04-04T16:30:00Z"],
        id="sydney-fixed-in-repeat-fires-first-only",
    ),
    pytest.param(
        "Australia/Sydney",
        "0 * * * *",
        "2027-10-02T14:30:00Z",
        ["2027-10-02T15:00:00Z", "2027-10-02T16:00:00Z", "2027-10-02T17:00:00Z"],
        id="sydney-wildcard-across-gap",
    ),
    pytest.param(
        "Australia/Sydney",
        "0 * * * *",
        "2027-04-03T14:30:00Z",
        ["2027-04-03T15:00:00Z", "2027-04-03T16:00:00Z", "2027-04-03T17:00:00Z"],
        id="sydney-wildcard-fires-both-repeats",
    ),
    # Australia/Lord_Howe (30-minute shifts)
    pytest.param(
        "Australia/Lord_Howe",
        "15 2 * * *",
        "2027-10-02T12:00:00Z",
        ["2027-10-02T15:45:00Z", "2027-10-03T15:15:00Z"],
        id="lord-howe-fixed-in-gap-shifts-30-minutes",
    ),
    pytest.param(
        "Australia/Lord_Howe",
        "45 1 * * *",
        "2027-04-03T12:00:00Z",
        ["2027-04-03T14:45:00Z", "2027-04-04T15:15:00Z"],
        id="lord-howe-fixed-in-repeat-fires-first-only",
    ),
    pytest.param(
        "Australia/Lord_Howe",
        "15 * * * *",
        "2027-10-02T13:00:00Z",
        [
            "2027-10-02T13:45:00Z",
            "2027-10-02T14:45:00Z",
            "2027-10-02T16:15:00Z",
            "2027-10-02T17:15:00Z",
        ],
        id="lord-howe-wildcard-skips-0215",
    ),
    pytest.param(
        "Australia/Lord_Howe",
        "45 * * * *",
        "2027-04-03T13:00:00Z",
        [
            "2027-04-03T13:45:00Z",
            "2027-04-03T14:45:00Z",
            "2027-04-03T15:15:00Z",
            "2027-04-03T16:15:00Z",
        ],
        id="lord-howe-wildcard-fires-0145-twice",
    ),
    # America/Santiago (transitions at midnight)
    pytest.param(
        "America/Santiago",
        "30 0 * * *",
        "2027-09-05T00:00:00Z",
        ["2027-09-05T04:30:00Z", "2027-09-06T03:30:00Z"],
        id="santiago-fixed-in-midnight-gap-shifts-to-0130",
    ),
    pytest.param(
        "America/Santiago",
        "0 0 * * SUN",
        "2027-09-04T00:00:00Z",
        ["2027-09-05T04:00:00Z", "2027-09-12T03:00:00Z"],
        id="santiago-missing-sunday-midnight-fires-at-0100",
    ),
    pytest.param(
        "America/Santiago",
        "30 23 * * *",
        "2027-04-03T12:00:00Z",
        ["2027-04-04T02:30:00Z", "2027-04-05T03:30:00Z"],
        id="santiago-fixed-in-repeat-before-midnight-fires-first-only",
    ),
    pytest.param(
        "America/Santiago",
        "30 * * * *",
        "2027-04-04T01:00:00Z",
        [
            "2027-04-04T01:30:00Z",
            "2027-04-04T02:30:00Z",
            "2027-04-04T03:30:00Z",
            "2027-04-04T04:30:00Z",
        ],
        id="santiago-wildcard-fires-2330-twice",
    ),
    pytest.param(
        "America/Santiago",
        "30 * * * *",
        "2027-09-05T02:00:00Z",
        [
            "2027-09-05T02:30:00Z",
            "2027-09-05T03:30:00Z",
            "2027-09-05T04:30:00Z",
            "2027-09-05T05:30:00Z",
        ],
        id="santiago-wildcard-skips-0030",
    ),
    # Pacific/Apia skipped all of 2011-12-30.
    pytest.param(
        "Pacific/Apia",
        "0 12 30 12 *",
        "2011-12-29T00:00:00Z",
        ["2011-12-30T22:00:00Z", "2012-12-29T22:00:00Z"],
        id="apia-fixed-on-skipped-day-shifts-a-whole-day",
    ),
    pytest.param(
        "Pacific/Apia",
        "0 */12 30 12 *",
        "2011-12-29T00:00:00Z",
        ["2012-12-29T10:00:00Z", "2012-12-29T22:00:00Z"],
        id="apia-wildcard-on-skipped-day-waits-a-year",
    ),
]


@pytest.mark.parametrize(("zone_name", "expr", "after", "expected"), DST_CASES)
def test_next_fires_across_dst(zone_name: str, expr: str, after: str, expected: list[str]) -> None:
    fires = fires_between(parse(expr), zone(zone_name), ms(after), ms("2099-01-01T00:00:00Z"), 4)
    assert [iso(fire) for fire in fires][: len(expected)] == expected


# ---------------------------------------------------------------------------------------------
# fires_between
# ---------------------------------------------------------------------------------------------


def test_fires_between_includes_until_and_excludes_after() -> None:
    fires = fires_between(
        parse("0 * * * *"), UTC, ms("2027-01-01T00:00:00Z"), ms("2027-01-01T03:00:00Z"), 10
    )
    assert [iso(fire) for fire in fires] == [
        "2027-01-01T01:00:00Z",
        "2027-01-01T02:00:00Z",
        "2027-01-01T03:00:00Z",
    ]


def test_fires_between_stops_at_limit() -> None:
    fires = fires_between(
        parse("*/10 * * * * *"), UTC, ms("2027-01-01T00:00:00Z"), ms("2027-01-02T00:00:00Z"), 2
    )
    assert [iso(fire) for fire in fires] == ["2027-01-01T00:00:10Z", "2027-01-01T00:00:20Z"]


def test_fires_between_is_empty_when_nothing_fires() -> None:
    cron = parse("0 0 30 2 *")
    assert fires_between(cron, UTC, ms("2027-01-01T00:00:00Z"), ms("2040-01-01T00:00:00Z"), 5) == []
