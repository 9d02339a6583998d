"""upsert_many applies or refuses each schedule on its own across its commands (no I/O: the
intake is played by a stand-in ``send``): a command refused as too large is split and sent
again; a command left unanswered stops the call with what was answered before."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from cronbus import Client, CommandRefused, NoReply, UpsertManyIncomplete
from shared.contract import codec

HOOK = {"kind": "webhook", "url": "http://billing.example/remind"}


def hourly(schedule_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": 3600},
        "target": HOOK,
        **extra,
    }


class Intake(Client):
    """A client whose commands are answered here: bodies over ``max_bytes`` refused too_large,
    every other schedule applied (version 1), command number ``silent_at`` never answered."""

    def __init__(self, max_bytes: int = 1_000_000, silent_at: int | None = None) -> None:
        super().__init__("amqp://guest:guest@127.0.0.1:5672/", timeout_s=1)
        self.max_bytes = max_bytes
        self.silent_at = silent_at
        self.sent: list[list[str]] = []
        self.applied: list[str] = []

    async def send(  # type: ignore[override]
        self, namespace: str, verb: str, body: Mapping[str, Any], **_: Any
    ) -> dict[str, Any]:
        assert verb == "upsert_many"
        ids = [item["id"] for item in body["schedules"]]
        self.sent.append(ids)
        if len(self.sent) == self.silent_at:
            raise NoReply("no reply to test.upsert_many within 1s")
        if len(codec.dumps(dict(body))) > self.max_bytes:
            error = {"code": "too_large", "message": "too large", "details": []}
            return {
                "ok": False,
                "error": {**error, "details": [{"field": "(body)", "reason": "is too large"}]},
            }
        self.applied += ids
        return {"ok": True, "results": [{"id": i, "ok": True, "version": 1} for i in ids]}


async def test_a_chunk_refused_as_too_large_is_split_until_each_schedule_stands_alone() -> None:
    intake = Intake(max_bytes=1024)
    schedules = [hourly(f"s-{n}") for n in range(8)]
    schedules.insert(3, hourly("huge", target={**HOOK, "body": {"blob": "x" * 2000}}))
    results = await intake.upsert_many("billing", schedules)
    assert [r.id for r in results] == [s["id"] for s in schedules]
    assert [r.ok for r in results] == [True, True, True, False, True, True, True, True, True]
    huge = results[3].error
    assert huge is not None and huge.code == "too_large"
    assert sorted(intake.applied) == sorted(f"s-{n}" for n in range(8))
    assert len(intake.applied) == 8  # none sent twice once applied


async def test_a_command_left_unanswered_stops_with_what_was_answered_before() -> None:
    # Sent: all six (too large), s-0..s-2 (too large), s-0, s-1..s-2, then s-3..s-5 unanswered.
    intake = Intake(max_bytes=1024, silent_at=5)
    schedules = [hourly(f"s-{n}", labels={"pad": "y" * 200}) for n in range(6)]
    schedules.insert(1, hourly("bad", spec={"kind": "cron", "expr": "0 25 * * *"}))
    with pytest.raises(UpsertManyIncomplete) as stopped:
        await intake.upsert_many("billing", schedules)
    assert isinstance(stopped.value.__cause__, NoReply)
    assert intake.applied == ["s-0", "s-1", "s-2"]
    assert [(r.id, r.ok) if r else None for r in stopped.value.results] == [
        ("s-0", True),
        ("bad", False),
        ("s-1", True),
        ("s-2", True),
        None,
        None,
        None,
    ]
    assert "4 of 7 schedules answered" in str(stopped.value)


async def test_what_json_cannot_carry_is_refused_on_its_own_and_its_json_form_is_sent() -> None:
    intake = Intake()
    int_key: dict[Any, Any] = {**hourly("int-key"), 1: 2}
    results = await intake.upsert_many(
        "billing",
        [
            hourly("surrogate", labels={"team": "\ud800"}),
            int_key,
            # The intake reads these in their JSON form: a list, a string, a string.
            hourly(
                "json-forms",
                spec={"kind": "once", "at": dt.datetime(2099, 1, 1, tzinfo=dt.UTC)},
                labels={"run": uuid.UUID(int=7)},
            ),
        ],
    )
    assert [(r.id, r.ok) for r in results] == [
        ("surrogate", False),
        ("int-key", False),
        ("json-forms", True),
    ]
    for refused in (results[0].error, results[1].error):
        assert refused is not None and refused.code == "invalid_schedule"
        assert [e.field for e in refused.errors] == ["(body)"]
    assert intake.sent == [["json-forms"]]


async def test_a_single_command_refuses_what_json_cannot_carry_naming_the_body() -> None:
    intake = Intake()
    int_key: dict[Any, Any] = {**hourly("x"), 1: 2}
    for schedule in (hourly("x", labels={"team": "\ud800"}), int_key):
        with pytest.raises(CommandRefused) as refused:
            await intake.upsert("billing", schedule)
        assert refused.value.code == "invalid_command"
        assert [e.field for e in refused.value.errors] == ["(body)"]
    assert intake.sent == []
