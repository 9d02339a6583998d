"""The console's pure parts: id-prefix ranges, filters, upcoming fires with DST marks, the chart."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.console import views, web
from shared.contract import models, timefmt
from shared.rules import plan

ids = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=8)


@given(prefix=ids.filter(lambda p: bool(p.rstrip(views.TOP))), other=ids)
def test_prefix_bounds_hold_exactly_the_strings_with_the_prefix(prefix: str, other: str) -> None:
    low, high = views.prefix_bounds(prefix)

    def inside(text: str) -> bool:  # code point order is UTF-8 byte order (COLLATE "C")
        return low <= text < high

    assert inside(prefix + other)
    assert inside(other) == other.startswith(prefix)


def test_prefix_bounds_skip_surrogates_and_open_at_the_top() -> None:
    assert views.prefix_bounds("a\ud7ff") == ("a\ud7ff", "a\ue000")
    assert views.prefix_bounds("") == ("", views.TOP)
    assert views.prefix_bounds("x\U0010ffff") == ("x\U0010ffff", "y")
    assert views.prefix_bounds("\U0010ffff")[1] == views.TOP


def test_label_and_state_filters_name_the_field_when_wrong() -> None:
    assert views.parse_label(" team = billing ") == ("team", "billing")
    assert views.parse_label("") is None
    with pytest.raises(views.BadQuery, match="label: must be key=value"):
        views.parse_label("team")
    with pytest.raises(views.BadQuery, match="state: must be one of"):
        views.parse_state("deleted", ("active", "paused"))
    with pytest.raises(views.BadQuery, match="q: contains a NUL"):
        views.check_text("q", "a\x00b")


def _plan(spec: dict[str, object]) -> plan.Plan:
    item = models.Schedule.model_validate(
        {"id": "x", "spec": spec, "target": {"kind": "webhook", "url": "http://a.example/"}}
    )
    return plan.plan_of(item, 1)


def test_next_fires_show_the_spring_forward_shift_in_utc_and_local_time() -> None:
    berlin = _plan({"kind": "cron", "expr": "30 2 * * *", "timezone": "Europe/Berlin"})
    now = timefmt.parse_rfc3339_ms("2027-03-26T12:00:00Z")
    rows = views.upcoming_fires(berlin, now, fires=0, count=4)
    assert [r.utc for r in rows] == [
        "2027-03-27 01:30:00Z",
        "2027-03-28 01:30:00Z",  # 02:30 does not exist that night: 03:30 CEST
        "2027-03-29 00:30:00Z",
        "2027-03-30 00:30:00Z",
    ]
    assert rows[1].local.startswith("2027-03-28 03:30:00 CEST")
    assert rows[1].shift == "clocks changed: UTC+01:00 → UTC+02:00"
    assert [r.shift is not None for r in rows] == [False, True, False, False]


def test_next_fires_mark_the_repeated_hour_when_clocks_go_back() -> None:
    hourly = _plan({"kind": "cron", "expr": "0 * * * *", "timezone": "Europe/Berlin"})
    now = timefmt.parse_rfc3339_ms("2027-10-30T23:30:00Z")  # 01:30 CEST
    rows = views.upcoming_fires(hourly, now, fires=0, count=3)
    assert [r.local[:19] for r in rows] == [
        "2027-10-31 02:00:00",
        "2027-10-31 02:00:00",
        "2027-10-31 03:00:00",
    ]
    assert [r.repeated for r in rows] == [True, True, False]
    assert rows[1].shift == "clocks changed: UTC+02:00 → UTC+01:00"


def test_interval_schedules_are_shown_in_utc() -> None:
    rows = views.upcoming_fires(_plan({"kind": "interval", "every_s": 60}), 1, fires=0, count=2)
    assert [r.utc for r in rows] == ["1970-01-01 00:01:00Z", "1970-01-01 00:02:00Z"]
    assert rows[0].local.endswith("UTC (UTC+00:00)")


def test_the_chart_escapes_its_labels_and_marks_failures() -> None:
    svg = views.lateness_chart(
        [views.Point("<script>alert(1)</script>", 120, False), views.Point("b", 30, True)]
    )
    assert "<script>" not in svg
    assert "&lt;script&gt;" in svg
    assert svg.count('class="bar failed"') == 1
    assert "highest 120 ms" in svg
    assert views.lateness_chart([]) == ""


def test_quantiles_are_nearest_rank() -> None:
    assert views.quantile([5, 1, 3, 2, 4], 0.5) == 3
    assert views.quantile(list(range(1, 101)), 0.99) == 99
    assert views.quantile([], 0.5) is None


def test_the_audited_user_is_a_plain_bounded_spelling() -> None:
    assert web.audit_user("alice@example.com") == "alice@example.com"
    assert web.audit_user(None) == "anonymous"
    assert web.audit_user("eve\r\nX-Injected: 1<b>") == "eve__X-Injected__1_b_"
    assert len(web.audit_user("a" * 1000)) == 100


def test_waits_read_like_a_person_says_them() -> None:
    assert views.duration_text(850) == "850 ms"
    assert views.duration_text(42_000) == "42 s"
    assert views.duration_text(425_000) == "7 min 5 s"
    assert views.duration_text(465_156_700) == "5 d 9 h"
    assert views.duration_text(3_600_000) == "1 h"
    assert views.duration_text(-5) == "0 ms"


def test_the_chart_axis_label_has_room_for_its_unit() -> None:
    svg = str(views.lateness_chart([views.Point("a", 1_005, False)]))
    label = re.search(r'<text x="([\d.]+)" y="12" text-anchor="end" class="tick">([^<]+)<', svg)
    assert label is not None and label.group(2) == "1.0 s"
    # Right-aligned at x: about 6 px a character at the tick's size must fit left of it.
    assert float(label.group(1)) >= 6 * len("59 min 59 s")


def test_lateness_leaves_out_backfills_and_says_its_unit() -> None:
    summary = views.lateness_summary(
        [(19, False, False), (25, True, False), (624_973_037, False, True)]
    )
    assert (summary.count, summary.failed, summary.backfills) == (2, 1, 1)
    assert (summary.p50, summary.p99) == ("19 ms", "25 ms")
    assert views.lateness_text(1_005) == "1.0 s" and views.lateness_text(425_000) == "7 min 5 s"


def test_attempt_logs_keep_one_entry_per_attempt_in_order() -> None:
    entry = {"http_status": 503, "error": "HTTP 503", "started_ms": 1_000, "finished_ms": 1_019}
    log = [{**entry, "attempt": 2}, {**entry, "attempt": 1}, {**entry, "attempt": 1}, "junk"]
    attempts = views.attempts_of(log)
    assert [a.attempt for a in attempts] == [1, 2]
    assert attempts[0].took_ms == 19 and attempts[0].http_status == 503
    assert views.attempts_of(None) == ()


def test_rates_read_as_a_person_says_them() -> None:
    assert [views.rate_text(r) for r in (0, 0.2, 12, 600)] == ["0", "0.2/min", "12/min", "10.0/s"]


MINUTE = 60_000


@given(
    now=st.integers(10**12, 2 * 10**12),
    first_ago=st.none() | st.integers(0, 24 * 60 * MINUTE),
)
def test_a_rate_window_is_a_minute_or_more_of_what_was_recorded(
    now: int, first_ago: int | None
) -> None:
    first = None if first_ago is None else (now - first_ago) - (now - first_ago) % MINUTE
    start = views.rate_window_start(now, 5, first)
    five = now - now % MINUTE - 5 * MINUTE
    if start is None:
        # Only a namespace recorded for less than a minute has no rate.
        assert first is not None and now - first < MINUTE
    else:
        assert now - start >= MINUTE and five <= start
        assert first is None or start >= first  # never over time before it was recorded
        assert start == max(five, first if first is not None else five)


def test_rates_read_as_counted_over_their_window() -> None:
    assert views.per_minute(140, 0, 140_000) == 60
    assert views.per_minute(3, None, 10) is None
    assert views.rate_text(None) == "—"


def test_an_error_cell_names_the_failed_attempts_before_a_success() -> None:
    first = views.Attempt(1, 503, None, 0, 40)
    second = views.Attempt(2, None, "timeout", 1000, 11000)
    third = views.Attempt(3, 500, "HTTP 500", 3000, 3040)
    assert views.error_text(None, ()) == ""
    assert views.error_text("HTTP 502", (first,)) == "HTTP 502"  # the row's own error
    assert views.error_text(None, (first,)) == "attempt 1: HTTP 503"
    assert views.error_text(None, (first, second, third)) == (
        "attempt 1: HTTP 503; attempt 2: timeout; 1 more failed"
    )
