"""Per-schedule stats folded from execution rows (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.contract import validation
from shared.contract.errors import ValidationFailed
from shared.contract.rows import ExecutionRow
from shared.policy import stats


def row(status: str, attempts: int = 1, started: int = 0, **kw: object) -> ExecutionRow:
    fields: dict[str, object] = {
        "namespace": "acme",
        "id": "a",
        "nominal_ms": started,
        "is_trigger": False,
        "attempts": attempts,
        "status": status,
        "http_status": None,
        "error": "HTTP 500" if status in ("retrying", "dead") else None,
        "idempotency_key": "k",
        "started_ms": started,
        "finished_ms": started,
    }
    fields.update(kw)
    return ExecutionRow(**fields)  # type: ignore[arg-type]


def test_a_batch_folds_into_one_delta_per_schedule() -> None:
    rows = [
        row("retrying", 1, 1),
        row("dead", 2, 2),
        row("succeeded", 1, 3, id="b"),
        row("succeeded", 1, 4),
        row("dead", 1, 5, excluded=3),
        row("skipped", 1, 6, id="b"),
    ]
    a, b = stats.fold(rows)
    assert (a.id, a.fires, a.succeeded, a.failed, a.dead, a.excluded) == ("a", 3, 1, 3, 2, 3)
    assert a.trailing_dead == 1
    assert (a.last_status, a.last_error, a.last_ms) == ("dead", "HTTP 500", 5)
    assert (b.id, b.fires, b.succeeded, b.skipped, b.last_status) == ("b", 1, 1, 1, "skipped")


statuses = st.lists(
    st.tuples(st.sampled_from(["succeeded", "retrying", "dead", "skipped"]), st.integers(1, 3)),
    max_size=40,
)


@given(statuses)
def test_counts_add_up_and_the_run_of_failures_is_the_dead_after_the_last_success(
    items: list[tuple[str, int]],
) -> None:
    rows = [row(status, attempts, started=i) for i, (status, attempts) in enumerate(items)]
    deltas = stats.fold(rows)
    if not rows:
        assert deltas == []
        return
    (delta,) = deltas
    assert delta.succeeded == sum(1 for s, _ in items if s == "succeeded")
    assert delta.failed == sum(1 for s, _ in items if s in ("retrying", "dead"))
    assert delta.skipped == sum(1 for s, _ in items if s == "skipped")
    assert delta.fires == sum(1 for s, a in items if s != "skipped" and a == 1)
    finals = [s for s, _ in items if s in ("succeeded", "dead")]
    run = 0
    for status in finals:
        run = 0 if status == "succeeded" else run + 1
    assert delta.trailing_dead == run
    assert delta.last_status == items[-1][0]


def test_a_schedule_without_rows_shows_zeros_and_nulls() -> None:
    shown = stats.decorate({"state": "active", "version": 1}, None)
    assert shown["stats"] == {
        "fires": 0,
        "succeeded": 0,
        "failed": 0,
        "dead": 0,
        "skipped": 0,
        "excluded": 0,
        "consecutive_failures": 0,
        "last_status": None,
        "last_error": None,
        "last_fire_at": None,
    }
    assert shown["paused_reason"] is None


def test_paused_reason_is_failures_only_for_the_version_the_executor_paused() -> None:
    record = {name: 0 for name in stats.FIELDS} | {
        "last_status": "dead",
        "last_error": "x",
        "last_fire_at": None,
        "paused_version": 4,
    }
    assert stats.paused_reason("paused", 4, record) == "failures"
    assert stats.paused_reason("paused", 5, record) == "command"
    assert stats.paused_reason("active", 4, record) is None


@pytest.mark.parametrize("value", [0, 1001, "3", 2.5])
def test_pause_after_failures_is_an_integer_from_1_to_1000(value: object) -> None:
    with pytest.raises(ValidationFailed) as caught:
        validation.parse_command(
            "upsert",
            {
                "schedule": {
                    "id": "x",
                    "spec": {"kind": "interval", "every_s": 60},
                    "target": {"kind": "webhook", "url": "http://127.0.0.1:9/"},
                    "pause_after_failures": value,
                }
            },
        )
    assert caught.value.code == "invalid_schedule"
    assert caught.value.details[0]["field"] == "pause_after_failures"


@pytest.mark.parametrize("field", ["stats", "paused_reason"])
def test_what_replies_show_is_refused_in_an_upsert(field: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        validation.parse_command(
            "upsert",
            {
                "schedule": {
                    "id": "x",
                    "spec": {"kind": "interval", "every_s": 60},
                    "target": {"kind": "webhook", "url": "http://127.0.0.1:9/"},
                    field: None,
                }
            },
        )
    assert caught.value.details[0]["field"] == field
    assert "read-only" in caught.value.details[0]["reason"]


def test_deltas_and_minutes_come_in_one_order_whatever_the_rows_order() -> None:
    """Executors lock these rows in the order written: one order for all, so no deadlock."""
    rows = [
        ExecutionRow("b", "2", 0, False, 1, "succeeded", 200, None, "k1", 120_000, 120_001),
        ExecutionRow("a", "9", 0, False, 1, "succeeded", 200, None, "k2", 60_000, 60_001),
        ExecutionRow("a", "1", 0, False, 1, "dead", None, "x", "k3", 180_000, 180_001),
    ]
    for order in (rows, rows[::-1]):
        assert [(d.namespace, d.id) for d in stats.fold(order)] == [
            ("a", "1"),
            ("a", "9"),
            ("b", "2"),
        ]
        assert [(m.namespace, m.minute_ms) for m in stats.minutes(order)] == [
            ("a", 60_000),
            ("a", 180_000),
            ("b", 120_000),
        ]
