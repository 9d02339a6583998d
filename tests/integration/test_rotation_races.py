"""Review of the policies change (tombstones, catch-ups, fencing, generations) against the
real Redis, PostgreSQL and RabbitMQ. Each test here failed on the change as reviewed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aio_pika
import asyncpg
from aio_pika.abc import AbstractRobustConnection

from cronbus.cli.sink import Sink
from services.dispatcher import batch
from services.dispatcher.intake import Intake
from services.sweeper.repair import TOMBSTONE_KEEP_MS
from services.sweeper.sweeper import Sweeper
from shared.contract import codec, delivery, timefmt, validation
from shared.contract.entries import Claimed
from shared.contract.rows import CommandAudit
from shared.policy import netpolicy
from shared.postgres import bulk
from shared.postgres.store import Store
from shared.rabbitmq import amqp
from shared.redis.index import Index
from shared.runtime.config import DispatcherSettings, SweeperSettings
from tests.conftest import SHARDS
from tests.integration.test_executor_decisions import claim_one, executor_with_clock


def make_sweeper(index: Index, store: Store, redis_prefix: str, database_url: str) -> Sweeper:
    settings = SweeperSettings(redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url)
    return Sweeper(settings, index, store, asyncio.Event())


async def load(store: Store, index: Index, namespace: str, *items: dict[str, object]) -> None:
    result = await bulk.import_lines(
        [codec.dumps(i) for i in items],
        namespace,
        store,
        index,
        validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK),
        workers=1,
    )
    assert not result.refused, result.refused


def every(schedule_id: str, seconds: int, url: str = "http://127.0.0.1:9/x") -> dict[str, object]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": seconds},
        "target": {"kind": "webhook", "url": url},
    }


async def members(index: Index) -> set[str]:
    found: set[str] = set()
    for shard in range(SHARDS):
        names = await index.client.hkeys(index.keys.sched(shard))
        found |= {m.decode() if isinstance(m, bytes) else m for m in names}
    return found


async def test_a_keep_upsert_before_the_first_fire_does_not_refuse_the_in_flight_checkpoint(
    index: Index, store: Store, connection: AbstractRobustConnection, sink: Sink, redis_prefix: str
) -> None:
    # Version 1, never fired yet; its first occurrence is claimed (in flight, plan version 1).
    body = await claim_one(index, store, sink)
    [occ] = delivery.decode(body)
    # A change that keeps the fire times (a label): version 2, the rotation is kept, and the
    # occurrence in flight stays current.
    changed: dict[str, object] = {
        "id": "s",
        "spec": {"kind": "interval", "every_s": 2},
        "target": {"kind": "webhook", "url": f"{sink.url}/s"},
        "labels": {"team": "billing"},
    }
    await load(store, index, "ex", changed)
    executor, webhooks, audit = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=0
    )
    try:
        [live] = await executor.hold([occ])
        await executor.process(live)
        await executor.drain()
        assert await audit.flush()
    finally:
        await webhooks.close()
    assert len(sink.received) == 1  # delivered, and completed in Redis (rotation kept)
    due, lease, _ = await index.position(occ.shard, occ.member)
    assert lease is None and due == occ.nominal_ms + 2000
    # PostgreSQL must record that fire: it is the truth a rebuild restarts from.
    row = await store.get_schedule("ex", "s")
    assert row is not None and row.version == 2
    assert (row.fires, row.last_fire_ms) == (1, occ.nominal_ms)


async def test_an_orphan_scan_racing_a_recreate_does_not_bury_the_new_schedule(
    index: Index, store: Store, redis_prefix: str, database_url: str
) -> None:
    clock_offset = [0.0]
    sweeper = make_sweeper(index, store, redis_prefix, database_url)
    sweeper.clock = lambda: time.time() + clock_offset[0]
    await load(store, index, "sw", every("phoenix", 60))
    # Deleted in PostgreSQL; the intake's index write (after the commit) has not landed yet.
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE schedules SET state = 'deleted', version = version + 1 WHERE id = 'phoenix'"
        )
    finally:
        await conn.close()
    real = store.schedule_states
    calls = 0

    async def read_then_recreate(pairs: Any) -> Any:
        # The orphan scan reads PostgreSQL; the user recreates the schedule right after that
        # read (PostgreSQL v3, then the index v3), before the scan's remove lands.
        nonlocal calls
        rows = await real(pairs)
        calls += 1
        if calls == 1:
            await load(store, index, "sw", every("phoenix", 60))
        return rows

    store.schedule_states = read_then_recreate  # type: ignore[method-assign,assignment]
    shard = index.shard_of("sw", "phoenix")
    try:
        await sweeper._remove_orphans(shard)
    finally:
        del store.schedule_states
    row = await store.get_schedule("sw", "phoenix")
    assert row is not None and (row.state, row.version) == ("active", 3)
    # Drift repair (a full scan) and the tombstone trim run later, past the tombstone's age.
    await sweeper.full_drift_scan()
    clock_offset[0] = (TOMBSTONE_KEEP_MS + 60_000) / 1000
    await sweeper.trim_tombstones()
    await sweeper.full_drift_scan()
    row = await store.get_schedule("sw", "phoenix")
    assert row is not None and row.state == "active", "the recreated schedule was ended"
    assert "sw/phoenix" in await members(index), "the recreated schedule never fires"


async def test_one_unexpected_failure_does_not_end_the_occurrence_dead(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    sink: Sink,
    redis_prefix: str,
    database_url: str,
) -> None:
    body = await claim_one(index, store, sink)
    [occ] = delivery.decode(body)
    executor, webhooks, audit = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=0
    )
    channel = await connection.channel()
    deliveries = await amqp.deliveries_queue_of(channel)
    await channel.default_exchange.publish(aio_pika.Message(body), routing_key=deliveries.name)
    message = await deliveries.get(timeout=5)
    assert message is not None

    async def fails_once(*_: object) -> Any:
        # One unexpected error (a bug hit once, a library raising what it should not).
        raise RuntimeError("unexpected")

    executor._deliver = fails_once  # type: ignore[method-assign,assignment]
    try:
        await executor.handle(message)
        # Back in the queue (its delivery limit counts the failures), not dead-lettered.
        again = await deliveries.get(timeout=5)
        assert again is not None and again.body == body and again.redelivered
        dead = await amqp.dead_deliveries_queue_of(channel)
        assert await dead.get(fail=False) is None
        await again.nack(requeue=False)
        await executor.drain()
        await audit.flush()
    finally:
        await webhooks.close()
    conn = await asyncpg.connect(database_url)
    try:
        status = await conn.fetchval("SELECT status FROM executions WHERE id = 's'")
    finally:
        await conn.close()
    # Redelivered once, not past the delivery limit: it must still be delivered some day.
    assert status != "dead", "one failure (not a poison message) ended the occurrence dead"
    due, lease, _ = await index.position(occ.shard, occ.member)
    assert lease is not None or due == occ.fire_ms


async def test_a_sweeper_that_reads_the_generation_while_another_advances_it_keeps_the_index(
    index: Index, store: Store, redis_prefix: str, database_url: str
) -> None:
    first = make_sweeper(index, store, redis_prefix, database_url)
    second = make_sweeper(index, store, redis_prefix, database_url)
    await load(store, index, "sw", every("kept", 60))
    await first.check_epoch()
    assert first.rebuilding is not None
    await first.rebuilding
    first.rebuilding = None
    # Two sweepers in check_epoch at once (the sweep lock expired under a slow step): the
    # second advances the generation (Redis, then PostgreSQL) between the first one's read of
    # Redis and its read of PostgreSQL.
    real = store.index_generation
    raced = False

    async def advanced_meanwhile() -> int:
        nonlocal raced
        if not raced:
            raced = True
            await second.check_epoch()
        return await real()

    store.index_generation = advanced_meanwhile  # type: ignore[method-assign]
    try:
        await first.check_epoch()
    finally:
        del store.index_generation
    wiped = first.rebuilding is not None
    if first.rebuilding is not None:
        await first.rebuilding
    # Nothing was restored from a snapshot: the live index must not be wiped.
    assert not wiped, "a live index was taken for a stale one and wiped"
    assert await members(index) == {"sw/kept"}


async def test_a_long_rebuild_does_not_bring_back_a_schedule_deleted_while_it_ran(
    index: Index, store: Store, redis_prefix: str, database_url: str
) -> None:
    settings = SweeperSettings(
        redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url, rebuild_batch=1
    )
    rebuilder = Sweeper(settings, index, store, asyncio.Event())
    # The sweep steps (tombstone trims included) go on while the rebuild streams; this one
    # runs past the tombstones' age, as a rebuild of a big table can.
    trimmer = make_sweeper(index, store, redis_prefix, database_url)
    trimmer.clock = lambda: time.time() + (TOMBSTONE_KEEP_MS + 60_000) / 1000
    first = {**every("first", 60), "priority": 5}
    await load(store, index, "sw", first, every("doomed", 60))
    await index.client.delete(index.keys.epoch)  # Redis lost its data: a rebuild starts
    for shard in range(SHARDS):
        await index.client.delete(index.keys.sched(shard), index.keys.due(shard))
    real = rebuilder._write_entries
    stale_pages = 0

    async def delete_while_streaming(rows: Any, now: int) -> int:
        nonlocal stale_pages
        if any(row.id == "doomed" for row in rows):
            stale_pages += 1
            # The rebuild has read "doomed"; before it writes it, the user deletes it
            # (PostgreSQL, then the index: a tombstone), and later the tombstone is trimmed
            # (PostgreSQL agrees). (Deleting from the first page's write raced with the next
            # page's read: on a loaded machine "doomed" was read after the delete, and never
            # came stale.)
            conn = await asyncpg.connect(database_url)
            try:
                version = await conn.fetchval(
                    "UPDATE schedules SET state = 'deleted', version = version + 1 "
                    "WHERE id = 'doomed' RETURNING version"
                )
            finally:
                await conn.close()
            shard = index.shard_of("sw", "doomed")
            await index.remove({shard: [("sw/doomed", version)]})
            await trimmer.trim_tombstones()
        return await real(rows, now)

    rebuilder._write_entries = delete_while_streaming  # type: ignore[method-assign]
    await rebuilder.rebuild()
    assert stale_pages == 1
    assert "sw/doomed" not in await members(index), "a deleted schedule was rebuilt"


async def test_an_after_completion_delay_is_measured_on_the_redis_clock(
    index: Index, store: Store, connection: AbstractRobustConnection, sink: Sink, redis_prefix: str
) -> None:
    body = await claim_one(index, store, sink, spec={"kind": "after_completion", "delay_s": 1})
    [occ] = delivery.decode(body)
    # This executor's host runs an hour behind (the Redis clock is the one that counts).
    executor, webhooks, _ = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=-3600
    )
    try:
        [live] = await executor.hold([occ])
        await executor.process(live)
        await executor.drain()
    finally:
        await webhooks.close()
    assert len(sink.received) == 1
    seconds, micros = await index.client.time()
    redis_now = seconds * 1000 + micros // 1000
    due, _, _ = await index.position(occ.shard, occ.member)
    # The next run comes a delay after the completion, not an hour before it (which would
    # fire it again at once: the delay between runs is lost).
    assert due is not None and due >= redis_now, f"next run {redis_now - (due or 0)} ms ago"


async def test_a_rebuild_judges_misfires_on_the_redis_clock_not_the_sweeper_host(
    index: Index, store: Store, redis_prefix: str, database_url: str
) -> None:
    sweeper = make_sweeper(index, store, redis_prefix, database_url)
    sweeper.clock = lambda: time.time() + 5  # this sweeper's host runs 5 s ahead
    await load(store, index, "sw", {**every("on-time", 60), "misfire": {"policy": "skip"}})
    seconds, micros = await index.client.time()
    due_now = seconds * 1000 + micros // 1000  # on time by Redis (grace 1 s)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE schedules SET next_fire_at = to_timestamp($1 / 1000.0) WHERE id = 'on-time'",
            due_now,
        )
    finally:
        await conn.close()
    await index.client.delete(index.keys.epoch)  # Redis lost its data: a rebuild
    for shard in range(SHARDS):
        await index.client.delete(index.keys.sched(shard), index.keys.due(shard))
    await sweeper.rebuild()
    due, _, _ = await index.position(index.shard_of("sw", "on-time"), "sw/on-time")
    assert due == due_now, "an occurrence on time by the Redis clock was skipped"


async def test_a_once_edited_right_after_it_fired_does_not_fire_again(
    index: Index, store: Store, connection: AbstractRobustConnection, sink: Sink, redis_prefix: str
) -> None:
    at = (int(time.time()) + 2) * 1000
    once: dict[str, object] = {
        "id": "s",
        "spec": {"kind": "once", "at": timefmt.format_ms(at)},
        "target": {"kind": "webhook", "url": f"{sink.url}/s"},
        "misfire": {"policy": "fire_once"},
    }
    await load(store, index, "ex", once)
    deadline = time.monotonic() + 10
    claimed: list[Claimed] = []
    while not claimed and time.monotonic() < deadline:
        claimed = [c for r in await index.claim(range(index.shards), 10, 30_000) for c in r.claimed]
        await asyncio.sleep(0.05)
    [occ] = delivery.decode(delivery.encode(claimed))
    executor, webhooks, audit = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=0
    )
    try:
        [live] = await executor.hold([occ])
        await executor.process(live)  # delivered and finished in Redis
        await executor.drain()
        # The user edits a label before the executor's audit batch (the checkpoint) lands.
        await load(store, index, "ex", {**once, "labels": {"team": "billing"}})
        assert await audit.flush()
        # Anything due again would be delivered a second time.
        again = [c for r in await index.claim(range(index.shards), 10, 30_000) for c in r.claimed]
        if again:
            [second] = await executor.hold(delivery.decode(delivery.encode(again)))
            await executor.process(second)
            await executor.drain()
    finally:
        await webhooks.close()
    assert len(sink.received) == 1, f"the once was delivered {len(sink.received)} times"


async def test_a_once_paused_right_after_it_fired_does_not_fire_again_on_resume(
    index: Index, store: Store, connection: AbstractRobustConnection, sink: Sink, redis_prefix: str
) -> None:
    async def no_wake(shard: int, fire_ms: int) -> None:
        return None

    channel = await connection.channel()
    intake = Intake(
        DispatcherSettings(redis_prefix=redis_prefix, shards=SHARDS),
        store,
        index,
        channel,
        no_wake,
        asyncio.Event(),
    )
    at = (int(time.time()) + 2) * 1000
    once: dict[str, object] = {
        "id": "s",
        "spec": {"kind": "once", "at": timefmt.format_ms(at)},
        "target": {"kind": "webhook", "url": f"{sink.url}/s"},
        "misfire": {"policy": "fire_once"},
    }
    await load(store, index, "ex", once)
    deadline = time.monotonic() + 10
    claimed: list[Claimed] = []
    while not claimed and time.monotonic() < deadline:
        claimed = [c for r in await index.claim(range(index.shards), 10, 30_000) for c in r.claimed]
        await asyncio.sleep(0.05)
    [occ] = delivery.decode(delivery.encode(claimed))
    executor, webhooks, audit = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=0
    )
    try:
        [live] = await executor.hold([occ])
        await executor.process(live)  # delivered and finished in Redis
        await executor.drain()
        # Paused before the executor's audit batch (the checkpoint) lands; resumed later.
        pause = CommandAudit("ex", "pause", "s", "ok")
        await intake.apply_batch([batch.ChangeItem("ex", "s", "pause", pause)])
        assert await audit.flush()
        resume = CommandAudit("ex", "resume", "s", "ok")
        await intake.apply_batch([batch.ChangeItem("ex", "s", "resume", resume)])
        again = [c for r in await index.claim(range(index.shards), 10, 30_000) for c in r.claimed]
        if again:
            [second] = await executor.hold(delivery.decode(delivery.encode(again)))
            await executor.process(second)
            await executor.drain()
    finally:
        await webhooks.close()
    row = await store.get_schedule("ex", "s")
    assert row is not None
    assert len(sink.received) == 1, (
        f"the once was delivered {len(sink.received)} times (PostgreSQL: fires {row.fires})"
    )
