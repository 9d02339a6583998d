"""Many upserts applied as one: each item as a single upsert would be (pure)."""

from __future__ import annotations

import dataclasses

from services.dispatcher import batch
from shared.contract import models, timefmt, validation
from shared.contract.errors import ValidationFailed

NOW = timefmt.parse_rfc3339_ms("2027-01-01T00:00:00Z")


def item(schedule_id: str, every_s: int, expected: int | None = None) -> batch.UpsertItem:
    schedule = models.Schedule.model_validate(
        {
            "id": schedule_id,
            "spec": {"kind": "interval", "every_s": every_s},
            "target": {"kind": "webhook", "url": "http://billing.example:9/h"},
        }
    )
    plan = validation.check_schedule(schedule, 0, NOW, validation.TargetPolicy(), namespace="ns")
    return batch.UpsertItem("ns", schedule, plan, expected)


def test_items_apply_in_order_and_a_conflict_refuses_only_itself() -> None:
    effect = batch.apply_upserts(
        [item("a", 60), item("b", 60, expected=3), item("a", 120, expected=1), item("c", 60)],
        {},
        NOW,
        NOW + 5,
    )
    first, conflict, second, other = effect.results
    assert isinstance(first, dict) and first["created"] is True
    assert first["schedule"]["version"] == 1
    assert isinstance(conflict, ValidationFailed) and conflict.code == "version_conflict"
    assert isinstance(second, dict) and second["created"] is False
    assert second["schedule"]["version"] == 2 and second["schedule"]["spec"]["every_s"] == 120
    assert isinstance(other, dict) and other["schedule"]["version"] == 1
    # One row and one index write per schedule: the last one.
    assert {k: r.version for k, r in effect.rows.items()} == {("ns", "a"): 2, ("ns", "c"): 1}
    write, version = effect.index_writes[("ns", "a")]
    assert write is not None and version == 2
    assert second["schedule"]["updated_at"] == timefmt.format_ms(NOW + 5)


def test_pause_resume_and_delete_apply_in_order_with_upserts() -> None:
    effect = batch.apply_upserts(
        [
            item("a", 60),
            batch.ChangeItem("ns", "a", "pause"),
            batch.ChangeItem("ns", "a", "pause"),
            batch.ChangeItem("ns", "a", "resume"),
            batch.ChangeItem("ns", "a", "delete"),
            batch.ChangeItem("ns", "a", "resume"),
            batch.ChangeItem("ns", "b", "delete"),
        ],
        {},
        NOW,
        NOW,
    )
    _, paused, unchanged, resumed, deleted, after_delete, missing = effect.results
    assert isinstance(paused, dict) and paused["schedule"]["state"] == "paused"
    assert isinstance(unchanged, dict) and unchanged["unchanged"] is True
    assert unchanged["schedule"]["version"] == 2
    assert isinstance(resumed, dict) and resumed["schedule"]["state"] == "active"
    assert isinstance(deleted, dict) and deleted["schedule"]["version"] == 4
    assert isinstance(after_delete, ValidationFailed) and after_delete.code == "not_found"
    assert isinstance(missing, ValidationFailed) and missing.code == "not_found"
    assert effect.rows[("ns", "a")].state == "deleted"
    assert effect.index_writes[("ns", "a")] == (None, 4)  # removed from the index


def test_a_message_id_replays_the_same_command_and_refuses_another() -> None:
    first = batch.ChangeItem("ns", "a", "pause", message_id="m", body={"id": "a"})
    again = batch.ChangeItem("ns", "a", "pause", message_id="m", body={"id": "a"})
    other = batch.ChangeItem("ns", "a", "resume", message_id="m", body={"id": "a"})
    effect = batch.apply_upserts([item("a", 60), first, again, other], {}, NOW, NOW)
    _, paused, replay, conflict = effect.results
    assert isinstance(paused, dict) and isinstance(replay, dict)
    assert replay == {**paused, "duplicate": True}
    assert isinstance(conflict, ValidationFailed) and conflict.code == "conflict"


def test_the_same_definition_again_is_unchanged_and_keeps_its_version() -> None:
    effect = batch.apply_upserts(
        [item("a", 60), item("a", 60), item("a", 60, expected=1), item("a", 60, expected=5)],
        {},
        NOW,
        NOW,
    )
    created, again, expected, stale = effect.results
    assert isinstance(created, dict) and "unchanged" not in created
    assert isinstance(again, dict) and again["unchanged"] is True
    assert again["schedule"]["version"] == 1
    assert isinstance(expected, dict) and expected["unchanged"] is True
    # expected_version keeps its meaning: a stale one is a conflict, changed or not.
    assert isinstance(stale, ValidationFailed) and stale.code == "version_conflict"
    assert effect.rows[("ns", "a")].version == 1


def test_a_once_in_the_past_is_accepted_with_a_warning() -> None:
    schedule = models.Schedule.model_validate(
        {
            "id": "late",
            "spec": {"kind": "once", "at": "2026-12-31T23:00:00Z"},
            "target": {"kind": "webhook", "url": "http://billing.example:9/h"},
        }
    )
    plan = validation.check_schedule(schedule, 0, NOW, validation.TargetPolicy(), namespace="ns")
    (reply,) = batch.apply_upserts([batch.UpsertItem("ns", schedule, plan)], {}, NOW, NOW).results
    assert isinstance(reply, dict) and reply["ok"] is True
    (warning,) = reply["warnings"]
    assert warning["field"] == "spec.at" and "in the past" in warning["reason"]
    assert reply["schedule"]["next_fires"]  # it still fires, now

    # Applied again after it fired (completed) or before: unchanged, and no false warning.
    stored = batch.apply_upserts([batch.UpsertItem("ns", schedule, plan)], {}, NOW, NOW)
    row = stored.rows[("ns", "late")]
    for state in ("active", "completed"):
        current = {("ns", "late"): batch._stored(dataclasses.replace(row, state=state), NOW, NOW)}
        (again,) = batch.apply_upserts(
            [batch.UpsertItem("ns", schedule, plan)], current, NOW, NOW
        ).results
        assert isinstance(again, dict)
        assert again["unchanged"] is True and "warnings" not in again


def test_the_same_definition_resumes_a_schedule_paused_without_its_asking() -> None:
    created = batch.apply_upserts([item("a", 60)], {}, NOW, NOW)
    row = created.rows[("ns", "a")]
    paused = batch._stored(dataclasses.replace(row, state="paused"), NOW, NOW)
    (again,) = batch.apply_upserts([item("a", 60)], {("ns", "a"): paused}, NOW, NOW).results
    assert isinstance(again, dict) and "unchanged" not in again
    assert again["schedule"]["state"] == "active" and again["schedule"]["version"] == 2


def test_a_brief_item_is_applied_as_a_full_one_and_its_reply_names_id_and_version() -> None:
    full = batch.apply_upserts([item("a", 60), item("a", 120)], {}, NOW, NOW)
    brief_items = [dataclasses.replace(i, brief=True) for i in (item("a", 60), item("a", 120))]
    brief = batch.apply_upserts(brief_items, {}, NOW, NOW)
    assert brief.rows == full.rows and brief.index_writes == full.index_writes
    for short, long in zip(brief.results, full.results, strict=True):
        assert isinstance(short, dict) and isinstance(long, dict)
        assert short["schedule"] == {k: long["schedule"][k] for k in ("id", "version")}
        assert {**short, "schedule": None} == {**long, "schedule": None}
    row = full.rows[("ns", "a")]
    stored = {("ns", "a"): batch._stored(row, NOW, NOW)}
    (again,) = batch.apply_upserts([brief_items[1]], stored, NOW, NOW).results
    assert again == {
        "ok": True,
        "created": False,
        "unchanged": True,
        "schedule": {"id": "a", "version": 2},
    }
