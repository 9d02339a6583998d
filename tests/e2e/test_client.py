"""The public Python client against a real dispatcher: every method, refusals with their fields,
NotFound, a robust connection that comes back (and gets its reply), and the blocking client."""

from __future__ import annotations

import asyncio
import subprocess
import time
from datetime import UTC, datetime, timedelta
from urllib.parse import unquote, urlsplit

import pytest
from aio_pika.abc import AbstractRobustConnection

from cronbus import (
    Client,
    CommandRefused,
    CronSpec,
    NotFound,
    Schedule,
    StoredSchedule,
    SyncClient,
    WebhookTarget,
)
from cronbus.cli.sink import Sink
from shared.contract import timefmt
from tests.support import services
from tests.support.commands import an_hour_from_now
from tests.support.stack import Stack

HOOK = {"kind": "webhook", "url": "http://127.0.0.1:9/hook"}


def hourly(schedule_id: str, **extra: object) -> dict[str, object]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": 3600},
        "target": HOOK,
        **extra,
    }


async def test_every_method_returns_typed_replies(stack: Stack, sink: Sink, amqp_url: str) -> None:
    await stack.start_all(("dispatcher", "executor"))
    async with Client(amqp_url, timeout_s=20) as c:
        created = await c.upsert(
            "billing",
            {
                "id": "invoice-42",
                # From an hour on: at 09:00 in Berlin on a weekday it would fire during the test.
                "spec": {
                    "kind": "cron",
                    "expr": "0 9 * * MON-FRI",
                    "timezone": "Europe/Berlin",
                    "start_at": an_hour_from_now(),
                },
                "target": {"kind": "webhook", "url": f"{sink.url}/remind"},
                "labels": {"team": "billing"},
            },
        )
        assert isinstance(created, StoredSchedule)
        assert (created.id, created.version, created.state) == ("invoice-42", 1, "active")
        assert created.namespace == "billing" and len(created.next_fires) == 5
        assert all(t.tzinfo is not None and t.hour in (7, 8) for t in created.next_fires)
        assert isinstance(created.spec, CronSpec) and created.spec.timezone == "Europe/Berlin"

        # The typed model goes the same way as the dict.
        typed = Schedule(
            id="typed",
            spec=CronSpec(kind="cron", expr="*/5 * * * *"),
            target=WebhookTarget(kind="webhook", url=f"{sink.url}/typed"),
            labels={"team": "billing"},
        )
        assert (await c.upsert("billing", typed)).version == 1
        # The same definition again changes nothing: the version stays, and the reply says so.
        again = await c.upsert("billing", typed, expected_version=1)
        assert (again.version, again.unchanged) == (1, True)
        changed = typed.model_copy(update={"labels": {"team": "typed"}})
        moved = await c.upsert("billing", changed, expected_version=1)
        assert (moved.version, moved.unchanged) == (2, False)

        got = await c.get("billing", "invoice-42")
        assert got.version == 1 and got.stats is not None and got.stats.fires == 0
        assert got.breaker is not None and got.breaker.state == "closed"

        results = await c.upsert_many(
            "billing",
            [
                hourly("bulk-1", labels={"team": "ops"}),
                hourly("bad", spec={"kind": "cron", "expr": "0 25 * * *"}),
                # Refused by the intake itself: it needs the clock.
                hourly(
                    "gone",
                    spec={"kind": "once", "at": "2020-01-01T00:00:00Z"},
                    misfire={"policy": "skip"},
                ),
                hourly("bulk-2", labels={"team": "ops"}),
            ],
        )
        assert [(r.id, r.ok) for r in results] == [
            ("bulk-1", True),
            ("bad", False),
            ("gone", False),
            ("bulk-2", True),
        ]
        assert results[0].version == 1
        bad, gone = results[1].error, results[2].error
        assert bad is not None and bad.code == "invalid_schedule"
        assert [(e.field, e.reason) for e in bad.errors] == [
            ("spec.expr", "hour: 25 is out of range 0-23")
        ]
        assert gone is not None and gone.errors[0].field == "spec.at"

        # list: every page, filtered by labels.
        for number in range(5):
            await c.upsert("billing", hourly(f"page-{number}", labels={"team": "pages"}))
        paged = [s.id async for s in c.list("billing", labels={"team": "pages"}, page_size=2)]
        assert paged == [f"page-{n}" for n in range(5)]
        assert {s.id async for s in c.list("billing", labels={"team": "ops"})} == {
            "bulk-1",
            "bulk-2",
        }

        paused = await c.pause("billing", "invoice-42")
        assert (paused.state, paused.version, paused.next_fires) == ("paused", 2, [])
        resumed = await c.resume("billing", "invoice-42")
        assert resumed.state == "active" and resumed.version == 3

        run = await c.trigger("billing", "invoice-42")
        assert run.schedule.id == "invoice-42" and len(run.idempotency_key) == 36
        assert await sink.wait_for(lambda s: any(r.path == "/remind" for r in s.received), 15)
        [delivered] = [r for r in sink.received if r.path == "/remind"]
        assert delivered.headers["idempotency-key"] == run.idempotency_key
        assert delivered.fire_time == timefmt.format_ms(timefmt.datetime_to_ms(run.fire_time))

        end = datetime.now(UTC).replace(microsecond=0)
        occurrences = await c.backfill("billing", "page-0", end - timedelta(hours=3), end)
        assert occurrences == 3  # hourly on the epoch grid: three of them in any 3 hours

        deleted = await c.delete("billing", "invoice-42")
        assert deleted.state == "deleted"
        with pytest.raises(NotFound):
            await c.get("billing", "invoice-42")


async def test_refusals_name_each_field_and_not_found_is_one(stack: Stack, amqp_url: str) -> None:
    await stack.start_all(("dispatcher",))
    async with Client(amqp_url, timeout_s=20) as c:
        # Refused here, with the intake's own validation: no round trip needed.
        with pytest.raises(CommandRefused) as local:
            await c.upsert(
                "billing",
                {
                    "id": "x",
                    "spec": {"kind": "cron", "expr": "0 25 * * *", "timezone": "Mars/Base"},
                    "target": HOOK,
                },
            )
        assert local.value.code == "invalid_schedule"
        assert {(e.field, e.reason) for e in local.value.errors} == {
            ("spec.expr", "hour: 25 is out of range 0-23"),
            ("spec.timezone", "unknown time zone 'Mars/Base'"),
        }
        assert local.value.reply["ok"] is False
        with pytest.raises(CommandRefused) as namespace:
            await c.get("Not A Namespace", "x")
        assert namespace.value.code == "invalid_command"
        # Refused by the intake: compare-and-set, and a trigger of nothing.
        await c.upsert("billing", hourly("cas"))
        with pytest.raises(CommandRefused) as conflict:
            await c.upsert("billing", hourly("cas"), expected_version=7)
        assert conflict.value.code == "version_conflict" and not isinstance(
            conflict.value, NotFound
        )
        for call in (c.get, c.pause, c.resume, c.trigger, c.delete):
            with pytest.raises(NotFound) as missing:
                await call("billing", "nope")
            assert isinstance(missing.value, CommandRefused)
            assert missing.value.code == "not_found" and missing.value.errors[0].field == "id"
        with pytest.raises(NotFound):
            await c.backfill("billing", "nope", "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z")


async def test_a_reply_lost_with_the_connection_is_fetched_again(
    stack: Stack, amqp_url: str, endpoints: services.Endpoints
) -> None:
    """The broker closes the connection while a command waits for its reply: the robust
    connection comes back, the command goes again with its message_id, and is applied once."""
    vhost = unquote(urlsplit(amqp_url).path[1:])
    await stack.start_all(("dispatcher",))  # it declares the exchange and the commands queue
    await stack.stop(stack.running("dispatcher")[0])
    async with Client(amqp_url, timeout_s=60) as c:
        assert isinstance(c._connection, AbstractRobustConnection)
        # No dispatcher now: the command waits in the commands queue.
        waiting = asyncio.create_task(c.upsert("billing", hourly("survivor")))
        await asyncio.sleep(1)
        assert not waiting.done()
        closed = await asyncio.to_thread(
            subprocess.run,
            [*endpoints.rabbitmqctl, "close_all_connections", "-p", vhost, "test"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert closed.returncode == 0, closed.stderr
        await stack.start_all(("dispatcher",))
        stored = await asyncio.wait_for(waiting, 60)
        assert (stored.id, stored.version) == ("survivor", 1)
        # The same connection object carries on.
        assert (await c.get("billing", "survivor")).version == 1


def test_the_blocking_client_does_the_same(stack: Stack, amqp_url: str) -> None:
    asyncio.run(stack.start_all(("dispatcher",)))
    started = time.monotonic()
    with SyncClient(amqp_url, timeout_s=20) as c:
        stored = c.upsert("ops", hourly("sync-1", labels={"k": "v"}))
        assert stored.version == 1
        assert [r.ok for r in c.upsert_many("ops", [hourly("sync-2"), hourly("sync-3")])] == [
            True,
            True,
        ]
        assert [s.id for s in c.list("ops", page_size=1)] == ["sync-1", "sync-2", "sync-3"]
        assert c.get("ops", "sync-1").labels == {"k": "v"}
        assert c.pause("ops", "sync-1").state == "paused"
        assert c.resume("ops", "sync-1").state == "active"
        assert c.trigger("ops", "sync-2").schedule.id == "sync-2"
        assert c.delete("ops", "sync-3").state == "deleted"
        with pytest.raises(NotFound):
            c.get("ops", "sync-3")
    assert time.monotonic() - started < 60
