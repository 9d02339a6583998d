"""The backfill command on a real intake, PostgreSQL and Redis: field-named refusals that
change nothing, replays, replacement, delete, and durability across the loss of Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractRobustConnection

from services.dispatcher.intake import Intake, Meta, Received
from services.sweeper.sweeper import Sweeper
from shared.contract import codec, keys, timefmt
from shared.contract.entries import Completion
from shared.contract.rows import BackfillProgress, Checkpoint
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.runtime.config import DispatcherSettings, SweeperSettings
from tests.conftest import SHARDS
from tests.integration.conftest import no_wake

NS = "bf"
MINUTE = 60_000
#: Whole hours in the past, so that a minute grid gives round counts.
HOUR_AGO = (int(time.time() * 1000) // 3_600_000 - 2) * 3_600_000


def iso(ms: int) -> str:
    return timefmt.format_ms(ms)


@pytest.fixture
async def intake(
    store: Store, index: Index, connection: AbstractRobustConnection, redis_prefix: str
) -> Intake:
    channel = await connection.channel()
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    return Intake(settings, store, index, channel, no_wake, asyncio.Event())


async def send(
    intake: Intake, verb: str, body: dict[str, Any], message_id: str | None = None
) -> dict[str, Any]:
    # With a reply_to a refusal is answered (not dead-lettered); _apply returns the answer.
    meta = Meta(f"{NS}.{verb}", reply_to="amq.rabbitmq.reply-to", message_id=message_id)
    received = Received(codec.dumps(body), meta)
    reply = await intake._apply(received)
    assert reply is not None
    return reply


def schedule(schedule_id: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "spec": spec or {"kind": "interval", "every_s": 60},
        "target": {"kind": "webhook", "url": "https://example.com/x"},
    }


async def create(intake: Intake, schedule_id: str, spec: dict[str, Any] | None = None) -> None:
    reply = await send(intake, "upsert", {"schedule": schedule(schedule_id, spec)})
    assert reply["ok"], reply


def over(schedule_id: str, start: int, end: int, **extra: Any) -> dict[str, Any]:
    return {"id": schedule_id, "from": iso(start), "to": iso(end), **extra}


async def kept(store: Store) -> list[asyncpg.Record]:
    async with store.pool.acquire() as conn:
        return list(await conn.fetch("SELECT * FROM backfills ORDER BY id"))


async def held(index: Index, schedule_id: str) -> int | None:
    return await index.backfill_remaining(
        index.shard_of(NS, schedule_id), keys.member(NS, schedule_id)
    )


def refused_field(reply: dict[str, Any]) -> tuple[str, str, str]:
    assert reply["ok"] is False, reply
    [detail] = reply["error"]["details"]
    return reply["error"]["code"], detail["field"], detail["reason"]


async def test_a_backfill_is_kept_in_postgresql_and_the_index_before_its_reply(
    intake: Intake, store: Store, index: Index
) -> None:
    await create(intake, "s")
    reply = await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 30 * MINUTE))
    assert reply == {"ok": True, "backfill": {"occurrences": 30}}
    [row] = await kept(store)
    assert (row["next_ms"], row["remaining"], row["limit_count"]) == (HOUR_AGO, 30, 1000)
    assert await held(index, "s") == 30
    got = await send(intake, "get", {"id": "s"})
    assert got["schedule"]["backfill"] == {"remaining": 30}
    # The limit counts too.
    reply = await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 30 * MINUTE, limit=7))
    assert reply["backfill"] == {"occurrences": 7}
    assert await held(index, "s") == 7


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"from": "yesterday"}, "from", "RFC 3339"),
        ({"to": "2027-13-01T00:00:00Z"}, "to", "month must be in 1..12"),
        ({"to": None}, "to", ""),
        ({"from": iso(HOUR_AGO + MINUTE), "to": iso(HOUR_AGO)}, "to", "after from"),
        ({"from": iso(HOUR_AGO), "to": iso(HOUR_AGO)}, "to", "after from"),
        ({"to": iso(int(time.time() * 1000) + 3_600_000)}, "to", "replays the past"),
        ({"limit": 0}, "limit", "greater than or equal to 1"),
        ({"limit": 100_001}, "limit", "less than or equal to 100000"),
        ({"limit": "10"}, "limit", "integer"),
        ({"id": "no-such"}, "id", "no schedule"),
        ({"id": "bad/id"}, "id", ""),
        ({"extra": 1}, "extra", ""),
    ],
)
async def test_a_bad_backfill_is_refused_naming_the_field_and_changes_nothing(
    intake: Intake, store: Store, index: Index, body: dict[str, Any], field: str, reason: str
) -> None:
    await create(intake, "s")
    command = {**over("s", HOUR_AGO, HOUR_AGO + 10 * MINUTE), **body}
    code, named, why = refused_field(await send(intake, "backfill", command))
    assert named == field
    assert reason in why
    assert code in ("invalid_command", "not_found")
    assert await kept(store) == []
    assert await held(index, "s") is None


async def test_schedules_without_nominal_times_or_whose_rotation_ended_are_refused(
    intake: Intake, store: Store, index: Index
) -> None:
    await create(intake, "fixed-delay", {"kind": "after_completion", "delay_s": 60})
    _, field, reason = refused_field(
        await send(intake, "backfill", over("fixed-delay", HOUR_AGO, HOUR_AGO + MINUTE))
    )
    assert (field, "after_completion" in reason) == ("id", True)
    await create(intake, "done")
    async with store.pool.acquire() as conn:
        await conn.execute("UPDATE schedules SET state = 'completed' WHERE id = 'done'")
    _, field, reason = refused_field(
        await send(intake, "backfill", over("done", HOUR_AGO, HOUR_AGO + MINUTE))
    )
    assert (field, "completed" in reason) == ("id", True)
    assert await kept(store) == []


async def test_a_replayed_backfill_is_answered_and_a_reused_message_id_conflicts(
    intake: Intake, store: Store, index: Index
) -> None:
    await create(intake, "s")
    body = over("s", HOUR_AGO, HOUR_AGO + 5 * MINUTE)
    first = await send(intake, "backfill", body, message_id="m-1")
    [row] = await kept(store)
    again = await send(intake, "backfill", body, message_id="m-1")
    assert again == {**first, "duplicate": True}
    [same] = await kept(store)
    assert same["generation"] == row["generation"]  # not started again
    other = await send(intake, "backfill", {**body, "limit": 2}, message_id="m-1")
    assert other["ok"] is False and other["error"]["code"] == "conflict"
    assert await held(index, "s") == 5


async def test_a_new_backfill_replaces_the_running_one_and_delete_drops_it(
    intake: Intake, store: Store, index: Index
) -> None:
    await create(intake, "s")
    await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 5 * MINUTE))
    [first] = await kept(store)
    await send(intake, "backfill", over("s", HOUR_AGO + 20 * MINUTE, HOUR_AGO + 22 * MINUTE))
    [second] = await kept(store)
    assert second["generation"] > first["generation"]
    assert (second["next_ms"], second["remaining"]) == (HOUR_AGO + 20 * MINUTE, 2)
    due, _, _ = await index.position(index.shard_of(NS, "s"), keys.backfill_member(NS, "s"))
    assert due == HOUR_AGO + 20 * MINUTE
    # A backfill over nothing the schedule fires in ends the running one.
    empty = await send(intake, "backfill", over("s", HOUR_AGO + 1, HOUR_AGO + 2))
    assert empty["backfill"] == {"occurrences": 0}
    assert await kept(store) == [] and await held(index, "s") is None
    await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 5 * MINUTE))
    assert (await send(intake, "delete", {"id": "s"}))["ok"]
    assert await kept(store) == [] and await held(index, "s") is None
    assert await index.position(index.shard_of(NS, "s"), keys.backfill_member(NS, "s")) == (
        None,
        None,
        None,
    )


async def deliver_one(index: Index, store: Store, schedule_id: str) -> int:
    """Claim the backfill's occurrence and complete it as an executor does (index, then the
    batched PostgreSQL write of its progress); returns its nominal time."""
    shard = index.shard_of(NS, schedule_id)
    member = keys.backfill_member(NS, schedule_id)
    for _ in range(50):
        [result] = await index.claim([shard], 10, lease_ms=60_000)
        found = [c for c in result.claimed if c.member == member]
        for other in result.claimed:
            if other.member != member:
                await index.complete({shard: [Completion(other.member, other.token, None)]})
        if found:
            break
        await asyncio.sleep(0.05)
    [taken] = found
    following = taken.nominal_ms + MINUTE
    [code] = (await index.complete({shard: [Completion(member, taken.token, following)]}))[shard]
    left = code - 1
    await store.write_backfill_progress(
        [BackfillProgress(NS, schedule_id, taken.fires, following if left else None, left)]
    )
    return taken.nominal_ms


async def test_a_backfill_survives_the_loss_of_redis_and_goes_on_where_it_stood(
    intake: Intake, store: Store, index: Index, redis_prefix: str, database_url: str
) -> None:
    await create(intake, "s")
    await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 6 * MINUTE))
    assert [await deliver_one(index, store, "s") for _ in range(2)] == [
        HOUR_AGO,
        HOUR_AGO + MINUTE,
    ]
    assert await held(index, "s") == 4
    # Redis loses everything; the sweeper rebuilds the index from PostgreSQL.
    async for key in index.client.scan_iter(match=f"{redis_prefix}:*"):
        await index.client.delete(key)
    settings = SweeperSettings(redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url)
    sweeper = Sweeper(settings, index, store, asyncio.Event())
    await sweeper.check_epoch()
    assert sweeper.rebuilding is not None
    await sweeper.rebuilding
    assert await held(index, "s") == 4
    got = await send(intake, "get", {"id": "s"})
    assert got["schedule"]["backfill"] == {"remaining": 4}
    rest = [await deliver_one(index, store, "s") for _ in range(4)]
    assert rest == [HOUR_AGO + n * MINUTE for n in range(2, 6)]
    assert await held(index, "s") is None and await kept(store) == []
    assert "backfill" not in (await send(intake, "get", {"id": "s"}))["schedule"]


async def test_get_shows_the_kept_backfill_while_redis_has_lost_it(
    intake: Intake, store: Store, index: Index, redis_prefix: str
) -> None:
    await create(intake, "s")
    await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 6 * MINUTE))
    assert await deliver_one(index, store, "s") == HOUR_AGO
    # Redis loses everything; no sweeper has rebuilt the index yet.
    async for key in index.client.scan_iter(match=f"{redis_prefix}:*"):
        await index.client.delete(key)
    got = await send(intake, "get", {"id": "s"})
    # What PostgreSQL keeps: the rebuild resumes it there.
    assert got["schedule"]["backfill"] == {"remaining": 5}


async def test_redis_restored_from_an_older_snapshot_brings_back_no_replaced_or_deleted_backfill(
    intake: Intake, store: Store, index: Index, redis_prefix: str, database_url: str
) -> None:
    await create(intake, "replaced")
    await create(intake, "deleted")
    await send(intake, "backfill", over("replaced", HOUR_AGO, HOUR_AGO + 6 * MINUTE))
    await send(intake, "backfill", over("deleted", HOUR_AGO, HOUR_AGO + 6 * MINUTE))
    settings = SweeperSettings(redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url)
    sweeper = Sweeper(settings, index, store, asyncio.Event())
    await sweeper.check_epoch()  # no epoch yet: a rebuild sets it
    assert sweeper.rebuilding is not None
    await sweeper.rebuilding
    await sweeper.check_epoch()  # the generation moves on
    snapshot = {
        key: await index.client.dump(key)
        async for key in index.client.scan_iter(match=f"{redis_prefix}:*")
    }
    # After the snapshot: one backfill replaced by a shorter one, the other schedule deleted.
    reply = await send(intake, "backfill", over("replaced", HOUR_AGO, HOUR_AGO + 2 * MINUTE))
    assert reply["backfill"] == {"occurrences": 2}
    assert (await send(intake, "delete", {"id": "deleted"}))["ok"]
    await sweeper.check_epoch()
    # Redis comes back from the older snapshot.
    async for key in index.client.scan_iter(match=f"{redis_prefix}:*"):
        await index.client.delete(key)
    for key, value in snapshot.items():
        assert value is not None
        await index.client.restore(key, 0, value)
    assert await held(index, "deleted") == 6
    await sweeper.check_epoch()
    assert sweeper.rebuilding is not None
    await sweeper.rebuilding
    assert await held(index, "replaced") == 2
    assert await held(index, "deleted") is None
    shard = index.shard_of(NS, "deleted")
    assert await index.position(shard, keys.backfill_member(NS, "deleted")) == (None, None, None)
    assert [await deliver_one(index, store, "replaced") for _ in range(2)] == [
        HOUR_AGO,
        HOUR_AGO + MINUTE,
    ]
    assert await held(index, "replaced") is None and await kept(store) == []


async def test_a_redelivered_backfill_command_puts_back_the_backfill_its_first_delivery_lost(
    intake: Intake, store: Store, index: Index
) -> None:
    await create(intake, "s")
    command = over("s", HOUR_AGO, HOUR_AGO + 3 * MINUTE)
    assert (await send(intake, "backfill", command, "m-1"))["ok"]
    # As if the intake died between its commit and its index write (the ack was never sent).
    shard = index.shard_of(NS, "s")
    await index.client.hdel(index.keys.backfill(shard), keys.member(NS, "s"))
    await index.client.zrem(index.keys.due(shard), keys.backfill_member(NS, "s"))
    await index.client.hdel(index.keys.occ(shard), keys.backfill_member(NS, "s"))
    reply = await send(intake, "backfill", command, "m-1")
    assert reply == {"ok": True, "backfill": {"occurrences": 3}, "duplicate": True}
    assert await held(index, "s") == 3
    assert await deliver_one(index, store, "s") == HOUR_AGO
    # Redelivered again later: the backfill, held at its generation, is left as it stands.
    await send(intake, "backfill", command, "m-1")
    assert await held(index, "s") == 2


async def test_drift_repair_puts_back_a_backfill_the_index_never_got(
    intake: Intake, store: Store, index: Index, redis_prefix: str, database_url: str
) -> None:
    await create(intake, "s")
    await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 3 * MINUTE))
    # As if the intake died between its commit and its index write, two minutes ago.
    shard = index.shard_of(NS, "s")
    await index.client.hdel(index.keys.backfill(shard), keys.member(NS, "s"))
    await index.client.zrem(index.keys.due(shard), keys.backfill_member(NS, "s"))
    async with store.pool.acquire() as conn:
        await conn.execute("UPDATE backfills SET created_at = now() - interval '2 minutes'")
    settings = SweeperSettings(redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url)
    repair = Sweeper(settings, index, store, asyncio.Event()).backfill_repair
    now = int(time.time() * 1000)
    assert await repair.check(now) == 0  # seen missing once: an executor may be ending it
    assert await repair.check(now) == 1
    assert await held(index, "s") == 3
    assert await repair.check(now) == 0


async def test_a_schedule_whose_rotation_ends_takes_its_kept_backfill_with_it(
    intake: Intake, store: Store
) -> None:
    await create(intake, "s")
    await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 3 * MINUTE))
    # A late checkpoint of an older rotation finishes nothing, and ends no backfill.
    stale = Checkpoint(NS, "s", HOUR_AGO, None, 1, finished=True, version=0)
    await store.write_checkpoints([stale])
    assert len(await kept(store)) == 1
    await store.write_checkpoints(
        [Checkpoint(NS, "s", HOUR_AGO, None, 1, finished=True, version=1)]
    )
    assert await kept(store) == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"limit": True}, "limit"),
        ({"limit": 1.5}, "limit"),
        ({"limit": 10.0}, "limit"),
        ({"limit": -1}, "limit"),
        ({"limit": 2**64 - 1}, "limit"),
        ({"limit": None}, "limit"),
        ({"id": "s\x00"}, "id"),
        ({"id": "other/s"}, "id"),
        ({"id": "s#b"}, "id"),
        ({"id": ""}, "id"),
        ({"from": iso(HOUR_AGO) + "\x00"}, "from"),
        ({"from": "1969-12-31T23:59:59Z"}, "from"),
        ({"from": "\uff12\uff10\uff12\uff17-01-01T00:00:00Z"}, "from"),  # fullwidth digits
        ({"from": 1_700_000_000_000}, "from"),
        ({"to": "9999-12-31T23:59:59Z"}, "to"),
        ({"from_": iso(HOUR_AGO)}, "from_"),
    ],
)
async def test_hostile_backfills_are_refused_naming_the_field_and_change_nothing(
    intake: Intake, store: Store, index: Index, body: dict[str, Any], field: str
) -> None:
    await create(intake, "s")
    command = {**over("s", HOUR_AGO, HOUR_AGO + 10 * MINUTE), **body}
    code, named, _ = refused_field(await send(intake, "backfill", command))
    assert (code, named) == ("invalid_command", field)
    assert await kept(store) == []
    assert await held(index, "s") is None
    # The intake answers the next command.
    assert (await send(intake, "get", {"id": "s"}))["ok"]


async def test_a_backfill_with_no_occurrence_in_range_leaves_nothing_behind(
    intake: Intake, store: Store, index: Index
) -> None:
    # A cron with no time in the range, a schedule whose exclusions cover the range, a once
    # schedule at another instant: each answers 0 and keeps nothing.
    await create(intake, "noon", {"kind": "cron", "expr": "0 12 * * *"})
    excluded = {
        "kind": "interval",
        "every_s": 60,
        "exclude": [{"from": iso(HOUR_AGO - MINUTE), "to": iso(HOUR_AGO + 11 * MINUTE)}],
    }
    await create(intake, "excluded", excluded)
    await create(intake, "once", {"kind": "once", "at": iso(HOUR_AGO + 3 * 3_600_000)})
    hour = HOUR_AGO - HOUR_AGO % 86_400_000 + 13 * 3_600_000
    cases = [("noon", hour, hour + 10 * MINUTE), ("excluded", HOUR_AGO, HOUR_AGO + 10 * MINUTE)]
    cases.append(("once", HOUR_AGO, HOUR_AGO + 10 * MINUTE))
    for schedule_id, start, end in cases:
        # The 13:00 UTC window may be ahead today: the day before then.
        back = 86_400_000 if end > int(time.time() * 1000) else 0
        reply = await send(intake, "backfill", over(schedule_id, start - back, end - back))
        assert reply == {"ok": True, "backfill": {"occurrences": 0}}, (schedule_id, reply)
        assert await held(index, schedule_id) is None
        shard = index.shard_of(NS, schedule_id)
        member = keys.backfill_member(NS, schedule_id)
        assert await index.position(shard, member) == (None, None, None)
        assert "backfill" not in (await send(intake, "get", {"id": schedule_id}))["schedule"]
    assert await kept(store) == []
    assert await index.client.exists(*[index.keys.backfill(s) for s in range(SHARDS)]) == 0


async def test_a_backfill_of_a_once_schedule_replays_its_one_time(
    intake: Intake, store: Store, index: Index
) -> None:
    at = HOUR_AGO + 5 * MINUTE
    await create(intake, "once", {"kind": "once", "at": iso(at)})
    reply = await send(intake, "backfill", over("once", HOUR_AGO, HOUR_AGO + 10 * MINUTE))
    assert reply == {"ok": True, "backfill": {"occurrences": 1}}
    assert await deliver_one(index, store, "once") == at
    assert await held(index, "once") is None and await kept(store) == []


async def test_a_backfill_refuses_a_to_a_second_ahead_and_a_limit_past_64_bits(
    intake: Intake, store: Store, index: Index
) -> None:
    await create(intake, "s")
    ahead = intake.now_ms() + 1_000
    code, named, _ = refused_field(await send(intake, "backfill", over("s", HOUR_AGO, ahead)))
    assert (code, named) == ("invalid_command", "to")
    raw = codec.dumps(over("s", HOUR_AGO, HOUR_AGO + MINUTE)).replace(
        b"}", b',"limit":1' + b"0" * 40 + b"}"
    )
    received = Received(raw, Meta(f"{NS}.backfill", reply_to="amq.rabbitmq.reply-to"))
    reply = await intake._apply(received)
    assert reply is not None and reply["ok"] is False, reply
    assert await kept(store) == [] and await held(index, "s") is None


async def test_a_resume_that_completes_the_schedule_ends_its_backfill_everywhere(
    intake: Intake, store: Store, index: Index
) -> None:
    end = (intake.now_ms() // 1000 + 3) * 1000
    await create(intake, "s", {"kind": "interval", "every_s": 1, "end_at": iso(end)})
    assert (await send(intake, "pause", {"id": "s"}))["ok"]
    await send(intake, "backfill", over("s", HOUR_AGO, HOUR_AGO + 6 * MINUTE))
    assert len(await kept(store)) == 1
    await asyncio.sleep(max(0, end - intake.now_ms()) / 1000 + 0.1)
    # Resumed after its window ended: the rotation is over, and the backfill with it.
    reply = await send(intake, "resume", {"id": "s"})
    assert reply["ok"] and reply["schedule"]["state"] == "completed", reply
    assert await held(index, "s") is None
    # Nothing kept that no rebuild would restore and no completion would remove.
    assert await kept(store) == []
    assert "backfill" not in (await send(intake, "get", {"id": "s"}))["schedule"]
