"""Invariant 9 for runs outside the rotation: a trigger or a backfill answered ok is never undone
by Redis. Each takes its shard's position like every other change, so an index rolled back to a
copy taken before it (what a failover to a replica that lagged by the command leaves behind) is
fenced until the sweeper's position check has put the run back; one that ran to completion
before the rollback is not put back (not delivered twice).

Likewise the pause cronbus makes itself: a schedule auto-paused after repeated failures takes a
position like a pause command, and a rollback does not make it fire again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aio_pika.abc import AbstractRobustConnection

from services.dispatcher.intake import Intake, Meta, Received
from services.executor.autopause import AutoPause
from services.executor.events import Events
from services.sweeper.sweeper import Sweeper
from shared.contract import codec, keys, timefmt
from shared.contract.delivery import Occurrence
from shared.contract.entries import Claimed, Completion
from shared.contract.rows import BackfillProgress, ExecutionRow
from shared.postgres import positions
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.rules import compact, schedule
from shared.runtime.config import DispatcherSettings, SweeperSettings
from tests.conftest import SHARDS
from tests.integration.conftest import no_wake

NS = "runs"
MINUTE = 60_000
#: Whole hours in the past, so that a minute grid gives round counts.
HOUR_AGO = (int(time.time() * 1000) // 3_600_000 - 2) * 3_600_000


@pytest.fixture
async def intake(
    store: Store, index: Index, connection: AbstractRobustConnection, redis_prefix: str
) -> Intake:
    channel = await connection.channel()
    settings = DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS)
    return Intake(settings, store, index, channel, no_wake, asyncio.Event())


@pytest.fixture
async def sweeper(index: Index, store: Store, redis_prefix: str, database_url: str) -> Sweeper:
    """A sweeper whose index has been built (an epoch: the position check runs)."""
    settings = SweeperSettings(redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url)
    found = Sweeper(settings, index, store, asyncio.Event())
    await found.check_epoch()
    assert found.rebuilding is not None
    await found.rebuilding
    return found


async def send(intake: Intake, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    meta = Meta(f"{NS}.{verb}", reply_to="amq.rabbitmq.reply-to")
    reply = await intake._apply(Received(codec.dumps(body), meta))
    assert reply is not None and reply["ok"], reply
    return reply


async def create(intake: Intake, schedule_id: str, every_s: int = 3600) -> None:
    # Its first regular occurrence comes a whole interval after now: none during the test.
    body = {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": every_s},
        "target": {"kind": "webhook", "url": "https://example.com/x"},
    }
    await send(intake, "upsert", {"schedule": body})


async def trigger(intake: Intake, schedule_id: str) -> int:
    """Trigger it (answered ok); the run's time."""
    reply = await send(intake, "trigger", {"id": schedule_id})
    return timefmt.parse_rfc3339_ms(reply["trigger"]["fire_time"])


async def backfill(intake: Intake, schedule_id: str, minutes: int) -> None:
    body = {
        "id": schedule_id,
        "from": timefmt.format_ms(HOUR_AGO),
        "to": timefmt.format_ms(HOUR_AGO + minutes * MINUTE),
    }
    reply = await send(intake, "backfill", body)
    assert reply["backfill"] == {"occurrences": minutes}


async def snapshot(index: Index) -> dict[bytes, bytes]:
    """Every shard key's DUMP; the epoch and the other meta keys are left as they are, as on a
    replica a couple of seconds behind."""
    prefix = index.keys.prefix
    found = [k async for k in index.client.scan_iter(match=f"{prefix}:{{*}}:*", count=1000)]
    dumps = [await index.client.dump(key) for key in found]
    return {key: dump for key, dump in zip(found, dumps, strict=True) if dump is not None}


async def roll_back(index: Index, saved: dict[bytes, bytes]) -> None:
    """Every shard key back to the copy, at once."""
    prefix = index.keys.prefix
    now = [k async for k in index.client.scan_iter(match=f"{prefix}:{{*}}:*", count=1000)]
    pipe = index.client.pipeline(transaction=True)
    if now:
        pipe.delete(*now)
    for key, dump in saved.items():
        pipe.restore(key, 0, dump, replace=True)
    await pipe.execute()


async def claim_fenced(index: Index, store: Store, shard: int) -> list[Claimed]:
    """What a dispatcher would claim from the shard now (fenced by the answered positions);
    each claimed member completed at once, as an executor would, the run ending."""
    answered = {s: p.answered for s, p in (await positions.read(store.pool)).items()}
    [result] = await index.claim([shard], 100, lease_ms=60_000, answered=answered)
    for taken in result.claimed:
        await index.complete({shard: [Completion(taken.member, taken.token, None)]})
    return result.claimed


async def claimed(index: Index, store: Store, shard: int) -> list[str]:
    return [taken.member for taken in await claim_fenced(index, store, shard)]


async def ran_to_completion(store: Store, schedule_id: str, fire_ms: int) -> None:
    """The executor's audit of a trigger that succeeded (its pending row goes with it)."""
    now = int(time.time() * 1000)
    key = schedule.trigger_key(NS, schedule_id, fire_ms)
    await store.write_executions(
        [ExecutionRow(NS, schedule_id, fire_ms, True, 1, "succeeded", 200, None, key, now, now)]
    )


async def test_a_trigger_answered_before_a_rollback_is_delivered_once_after_the_replay(
    intake: Intake, store: Store, index: Index, sweeper: Sweeper
) -> None:
    await create(intake, "t")
    shard = index.shard_of(NS, "t")
    saved = await snapshot(index)
    fire_ms = await trigger(intake, "t")
    member = keys.trigger_member(NS, "t", fire_ms)
    await roll_back(index, saved)
    assert await index.position(shard, member) == (None, None, None)  # the rollback lost it
    # Until the replay nothing is claimed from the shard: it is behind the trigger's answer.
    assert await claimed(index, store, shard) == []
    await sweeper.check_positions()
    assert (await index.position(shard, member))[0] == fire_ms, "the trigger was not put back"
    assert await claimed(index, store, shard) == [member]
    assert await claimed(index, store, shard) == []


async def test_a_trigger_that_ran_before_the_rollback_is_not_put_back(
    intake: Intake, store: Store, index: Index, sweeper: Sweeper
) -> None:
    await create(intake, "t")
    shard = index.shard_of(NS, "t")
    saved = await snapshot(index)
    fire_ms = await trigger(intake, "t")
    member = keys.trigger_member(NS, "t", fire_ms)
    assert await claimed(index, store, shard) == [member]
    await ran_to_completion(store, "t", fire_ms)
    await roll_back(index, saved)
    await sweeper.check_positions()
    assert await index.position(shard, member) == (None, None, None)
    assert await claimed(index, store, shard) == []


async def test_a_duplicate_trigger_answered_again_is_fenced_until_replayed(
    intake: Intake, store: Store, index: Index, sweeper: Sweeper
) -> None:
    # A copy of the trigger redelivered after the rollback gets the first reply again.
    await create(intake, "t")
    shard = index.shard_of(NS, "t")
    saved = await snapshot(index)
    meta = Meta(f"{NS}.trigger", reply_to="amq.rabbitmq.reply-to", message_id="m-1")
    body = codec.dumps({"id": "t"})
    first = await intake._apply(Received(body, meta))
    assert first is not None and first["ok"], first
    fire_ms = timefmt.parse_rfc3339_ms(first["trigger"]["fire_time"])
    member = keys.trigger_member(NS, "t", fire_ms)
    await roll_back(index, saved)
    again = await intake._apply(Received(body, meta))
    assert again == {**first, "duplicate": True}
    await sweeper.check_positions()
    assert await claimed(index, store, shard) == [member]
    assert await claimed(index, store, shard) == []


async def held(index: Index, schedule_id: str) -> int | None:
    return await index.backfill_remaining(
        index.shard_of(NS, schedule_id), keys.member(NS, schedule_id)
    )


async def test_a_backfill_answered_before_a_rollback_goes_on_where_it_stood_after_the_replay(
    intake: Intake, store: Store, index: Index, sweeper: Sweeper
) -> None:
    await create(intake, "b", every_s=60)
    shard = index.shard_of(NS, "b")
    member = keys.backfill_member(NS, "b")
    saved = await snapshot(index)
    await backfill(intake, "b", 3)
    # The first occurrence is delivered and its progress written, as an executor does.
    [first] = await claim_fenced(index, store, shard)
    assert (first.member, first.nominal_ms) == (member, HOUR_AGO)
    await store.write_backfill_progress(
        [BackfillProgress(NS, "b", first.fires, HOUR_AGO + MINUTE, 2)]
    )
    await roll_back(index, saved)
    assert await held(index, "b") is None  # the rollback lost it
    assert await claimed(index, store, shard) == []
    await sweeper.check_positions()
    assert await held(index, "b") == 2, "the backfill was not put back where it stood"
    [second] = await claim_fenced(index, store, shard)
    assert (second.member, second.nominal_ms) == (member, HOUR_AGO + MINUTE)


async def due_claims(index: Index, store: Store, shard: int, member: str) -> int:
    """Occurrences of the schedule a dispatcher would claim a minute from now (fenced by the
    answered positions), handed back untouched."""
    answered = {s: p.answered for s, p in (await positions.read(store.pool)).items()}
    later = int(time.time() * 1000) + 60_000
    [result] = await index.claim([shard], 100, 60_000, now_ms=later, answered=answered)
    return sum(1 for taken in result.claimed if taken.member == member)


async def test_an_auto_pause_is_not_undone_by_a_rollback(
    intake: Intake,
    store: Store,
    index: Index,
    sweeper: Sweeper,
    connection: AbstractRobustConnection,
) -> None:
    body = {
        "id": "p",
        "spec": {"kind": "interval", "every_s": 1},
        "target": {"kind": "webhook", "url": "https://example.com/x"},
        "pause_after_failures": 3,
    }
    await send(intake, "upsert", {"schedule": body})
    shard, member = index.shard_of(NS, "p"), keys.member(NS, "p")
    stored = await index.stored_plan(shard, member)
    assert stored is not None
    saved = await snapshot(index)
    # Three occurrences ended dead: the executor pauses it (PostgreSQL, then the index).
    autopause = AutoPause(index, store, Events(connection, "none"), asyncio.Event(), flush_ms=1)
    now = int(time.time() * 1000)
    occ = Occurrence(shard, member, 1, now, now, 1, 3, compact.decode(stored), NS, "p", None)
    version = await autopause.pause(occ, 3)
    assert version is not None
    await roll_back(index, saved)  # the replica never got the pause
    assert await due_claims(index, store, shard, member) == 0, "fired again before the replay"
    await sweeper.check_positions()
    assert await due_claims(index, store, shard, member) == 0, "fired again after the replay"
    parked = await index.stored_plan(shard, member)
    assert parked is not None and compact.version_of(parked) == version
    row = await store.get_schedule(NS, "p")
    assert row is not None and row.state == "paused"
