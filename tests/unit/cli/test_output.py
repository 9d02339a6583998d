"""How the CLI shows schedules and executions to people (no I/O): aligned columns, a field a
line, and executions that --watch prints later lining up under the header."""

from __future__ import annotations

import datetime as dt
import io
from contextlib import redirect_stdout
from typing import Any

import pytest

from cronbus.cli import completion, output
from cronbus.cli.main import build_parser
from shared.contract.replies import StoredSchedule

NOW = "2027-01-04T08:00:00Z"


def stored(schedule_id: str, spec: dict[str, Any], **extra: Any) -> StoredSchedule:
    return StoredSchedule.model_validate(
        {
            "id": schedule_id,
            "spec": spec,
            "target": {"kind": "webhook", "url": "http://billing.example/remind"},
            "namespace": "billing",
            "version": 2,
            "state": "active",
            "fires": 7,
            "last_fire_at": None,
            "next_fires": [NOW, "2027-01-05T08:00:00Z"],
            "created_at": NOW,
            "updated_at": NOW,
            **extra,
        }
    )


def printed(table: Any) -> list[str]:
    out = io.StringIO()
    with redirect_stdout(out):
        output.print_table(table)
    return [line for line in out.getvalue().splitlines() if line.strip()]


def test_a_list_is_one_aligned_row_per_schedule() -> None:
    lines = printed(
        output.schedules_table(
            [
                stored(
                    "invoice-42",
                    {"kind": "cron", "expr": "0 9 * * MON-FRI", "timezone": "Europe/Berlin"},
                ),
                stored("a-much-longer-identifier", {"kind": "interval", "every_s": 60}),
            ],
            wide=False,
        )
    )
    header, rule, *rows = lines
    assert set(rule.strip()) == {"─"}
    assert all(line == line.rstrip() for line in lines)
    start = header.index("SCHEDULE")
    assert [row[start:].split("  ")[0] for row in rows] == [
        "cron 0 9 * * MON-FRI (Europe/Berlin)",
        "every 60s",
    ]
    assert all(row[header.index("NEXT FIRE") :].startswith(NOW) for row in rows)


def test_get_shows_a_field_a_line_and_wide_shows_more() -> None:
    schedule = stored(
        "invoice-42",
        {"kind": "once", "at": "2027-02-01T00:00:00Z"},
        state="paused",
        paused_reason="failures",
        labels={"team": "billing"},
    )
    fields = {
        line.split()[0]: line.split(None, 1)[1]
        for line in printed(output.schedule_table(schedule, wide=False))
        if line[:1].strip()
    }
    assert (
        fields["state"] == "paused (failures)" and fields["spec"] == "once at 2027-02-01T00:00:00Z"
    )
    assert fields["labels"] == "team=billing" and "retry" not in fields
    wide = printed(output.schedule_table(schedule, wide=True))
    assert any(line.startswith("retry") and "3 attempts" in line for line in wide)


def test_executions_line_up_under_the_header_whatever_their_width() -> None:
    row = {
        "nominal_at": dt.datetime(2027, 1, 4, 8, tzinfo=dt.UTC),
        "is_trigger": True,
        "is_backfill": False,
        "status": "dead",
        "attempts": 12,
        "http_status": 503,
        "lateness_ms": 1234567,
        "error": "HTTP 503",
        "started_at": None,
        "finished_at": None,
        "idempotency_key": "k",
    }
    header = output.execution_header(wide=False)
    line = output.execution_line(row, wide=False)
    assert line[header.index("KIND") :].startswith("trigger")
    assert line[header.index("STATUS") :].startswith("dead")
    assert line[header.index("ERROR") :] == "HTTP 503"
    assert output.plain(row)["nominal_at"] == "2027-01-04T08:00:00Z"


def test_completion_offers_every_subcommand() -> None:
    script = completion.script(build_parser(), "bash")
    for name in ("apply", "get", "list", "executions", "completion", "bench", "preview"):
        assert f"[cronbus\\ {name}]=" in script or f"['cronbus {name}']=" in script
    assert "bashcompinit" in completion.script(build_parser(), "zsh")


HOSTILE = {
    "team": "[/oops]",
    "boss": "[bold red]boss[/]",
    "mood": "a:thumbs_up:b",
}
HOSTILE_URL = "http://127.0.0.1:8099/[link=http://evil]x"


def test_user_text_is_printed_as_written_never_as_markup_or_emoji() -> None:
    schedule = stored(
        "invoice-42",
        {"kind": "interval", "every_s": 60},
        labels=HOSTILE,
        target={"kind": "webhook", "url": HOSTILE_URL},
    )
    expected_labels = output.labels_text(HOSTILE)
    assert expected_labels == "team=[/oops],boss=[bold red]boss[/],mood=a:thumbs_up:b"
    for wide in (False, True):
        text = "\n".join(printed(output.schedule_table(schedule, wide=wide)))
        assert expected_labels in text
        assert f"POST {HOSTILE_URL}" in text
        assert "👍" not in text
    listed = "\n".join(printed(output.schedules_table([schedule], wide=True)))
    assert expected_labels in listed and HOSTILE_URL in listed and "👍" not in listed


def execution(hour: int, **extra: Any) -> dict[str, Any]:
    row = {
        "nominal_at": dt.datetime(2027, 1, 4, hour, tzinfo=dt.UTC),
        "is_trigger": False,
        "is_backfill": False,
        "status": "succeeded",
        "attempts": 1,
        "http_status": 200,
        "lateness_ms": 3,
        "error": None,
        "started_at": None,
        "finished_at": None,
        "idempotency_key": f"key-{hour}",
    }
    return {**row, **extra}


def test_watch_prints_a_backfill_once_beside_its_occurrence_and_in_order() -> None:
    # Newest first, as PostgreSQL gives them: a backfill shares its occurrence's key.
    rows = [execution(10, is_backfill=True), execution(10), execution(9)]
    seen: dict[Any, Any] = {}
    first = output.news(seen, rows)
    assert [(r["nominal_at"].hour, r["is_backfill"]) for r in first] == [
        (9, False),
        (10, False),
        (10, True),
    ]
    assert output.news(seen, rows) == []  # looked at again, nothing new: nothing printed
    moved = execution(10, is_backfill=True, status="dead", attempts=3)
    later = [execution(11), moved, execution(10), execution(9)]
    assert output.news(seen, later) == [moved, execution(11)]
    assert output.news(seen, later) == []


def test_executions_refuses_a_limit_or_interval_that_cannot_work() -> None:
    parser = build_parser()
    for argv in (
        ["executions", "x", "--limit", "-1"],
        ["executions", "x", "--limit", "0"],
        ["executions", "x", "--watch", "--interval", "0"],
        ["executions", "x", "--watch", "--interval", "nan"],
    ):
        with redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as usage:
            parser.parse_args(argv)
        assert usage.value.code == 2
    args = parser.parse_args(["executions", "x", "--limit", "5", "--interval", "0.5"])
    assert (args.limit, args.interval) == (5, 0.5)


def test_get_names_the_rotations_regular_fires_beside_every_fire() -> None:
    """Issue 36, newcomer 5: after a trigger the reply's schedule.fires said 0 and get said 1,
    nothing telling the two counts apart."""
    stats = {
        "fires": 1,
        "succeeded": 1,
        "failed": 0,
        "dead": 0,
        "skipped": 0,
        "excluded": 0,
        "consecutive_failures": 0,
        "last_status": "succeeded",
        "last_error": None,
        "last_fire_at": NOW,
    }
    triggered = stored("nightly", {"kind": "interval", "every_s": 3600}, fires=0, stats=stats)
    lines = printed(output.schedule_table(triggered, wide=False))
    (fires,) = [line for line in lines if line.startswith("fires")]
    assert fires.split(None, 1)[1] == (
        "1 (0 regular in the current rotation, which max_fires counts)"
    )
    # The same counts: one number, as before; and list's FIRES column is every fire.
    regular = stored("nightly", {"kind": "interval", "every_s": 3600}, fires=1, stats=stats)
    (fires,) = [
        line
        for line in printed(output.schedule_table(regular, wide=False))
        if line.startswith("fires")
    ]
    assert fires.split() == ["fires", "1"]
    assert output.fires_text(triggered) == "1"
