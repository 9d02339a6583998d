"""The executor's decisions against the real Redis, PostgreSQL and RabbitMQ: misfires judged
on the Redis clock, and poison delivery messages settled as dead."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractRobustConnection

from cronbus.cli.sink import Sink
from services.executor import settle
from services.executor.audit import AuditWriter
from services.executor.events import Events
from services.executor.executor import Executor
from services.executor.http import HttpClient
from services.executor.targets import AmqpTargets, Webhooks
from shared.contract import codec, delivery, keys, validation
from shared.contract.delivery import Occurrence
from shared.contract.entries import Claimed
from shared.policy import netpolicy
from shared.postgres import bulk
from shared.postgres.store import Store
from shared.rabbitmq import amqp
from shared.redis.index import Index
from shared.rules import schedule
from shared.runtime.config import ExecutorSettings


async def executor_with_clock(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    redis_prefix: str,
    skew_s: float,
    *,
    concurrency: int | None = None,
    audit_flush_ms: int = 10,
) -> tuple[Executor, Webhooks, AuditWriter]:
    """An executor whose clock is ``skew_s`` off; ``concurrency``: its delivery slots and its
    HTTP client's limit (else the default slots and 4 connections)."""
    settings = ExecutorSettings(redis_prefix=redis_prefix, shards=index.shards)
    if concurrency is not None:
        settings = settings.model_copy(update={"concurrency": concurrency})
    policy = netpolicy.AddressPolicy.from_text(netpolicy.LOOPBACK)
    webhooks = Webhooks(HttpClient(concurrency or 4, policy))
    audit = AuditWriter(store, audit_flush_ms, 10_000)
    executor = Executor(
        settings,
        index,
        webhooks,
        AmqpTargets(connection),
        audit,
        Events(connection, "none"),
        asyncio.Event(),
        clock=lambda: time.time() + skew_s,
    )
    return executor, webhooks, audit


async def claim_one(index: Index, store: Store, sink: Sink, **schedule_fields: object) -> bytes:
    item = {
        "id": "s",
        "spec": {"kind": "interval", "every_s": 2},
        "target": {"kind": "webhook", "url": f"{sink.url}/s"},
        **schedule_fields,
    }
    result = await bulk.import_lines(
        [codec.dumps(item)],
        "ex",
        store,
        index,
        validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK),
        workers=1,
    )
    assert not result.refused
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        claimed = [c for r in await index.claim(range(index.shards), 10, 30_000) for c in r.claimed]
        if claimed:
            return delivery.encode(claimed)
        await asyncio.sleep(0.05)
    raise AssertionError("nothing came due")


async def test_misfires_are_judged_on_the_redis_clock_not_the_executor_host(
    index: Index, store: Store, connection: AbstractRobustConnection, sink: Sink, redis_prefix: str
) -> None:
    body = await claim_one(index, store, sink, misfire={"policy": "skip"})
    # This executor's host runs 5 s ahead: by its own clock the occurrence is long missed.
    executor, webhooks, _ = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=5
    )
    try:
        [occ] = delivery.decode(body)
        live = await executor.hold([occ])
        await executor.process(live[0])
        await executor.drain()
    finally:
        await webhooks.close()
    assert [r.key for r in sink.received] == [schedule.idempotency_key("ex", "s", occ.nominal_ms)]


async def test_a_poison_delivery_message_ends_its_occurrences_dead_and_the_rotation_goes_on(
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
    dead_exchange = await channel.get_exchange(keys.DEAD_LETTER_EXCHANGE)
    # What the broker does once the message was redelivered past the queue's delivery limit.
    await dead_exchange.publish(
        aio_pika.Message(body, headers={"x-first-death-reason": "delivery_limit"}),
        routing_key=keys.dead_letter_queue(keys.DELIVERIES_QUEUE),
    )
    queue = await amqp.dead_deliveries_queue_of(channel)
    message = await queue.get(timeout=5)
    assert message is not None
    try:
        await executor.settle_dead_letter(message)
        await executor.drain()
        assert await audit.flush()
    finally:
        await webhooks.close()
    assert sink.received == []  # never delivered on
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT status, error FROM executions WHERE id = 's'")
    finally:
        await conn.close()
    assert row is not None and row["status"] == "dead"
    assert "delivery_limit" in row["error"]
    due, lease, _ = await index.position(occ.shard, occ.member)
    assert lease is None and due == occ.nominal_ms + 2000  # the next one is placed


async def test_an_amqp_delivery_refused_by_policy_takes_no_probe_of_its_rate_key(
    index: Index, store: Store, connection: AbstractRobustConnection, redis_prefix: str
) -> None:
    # Stored before the exchange policy narrowed: refused at every delivery. It shares its rate
    # key with deliveries that can go, whose breaker is half-open: the one probe is theirs.
    item = {
        "id": "refused",
        "spec": {"kind": "interval", "every_s": 2},
        "target": {"kind": "amqp", "exchange": "billing", "rate_key": "shared-api"},
    }
    result = await bulk.import_lines(
        [codec.dumps(item)],
        "ex",
        store,
        index,
        validation.TargetPolicy(allowed_exchanges=("*",)),
        workers=1,
    )
    assert not result.refused
    claimed: list[Claimed] = []
    deadline = time.monotonic() + 5
    while not claimed and time.monotonic() < deadline:
        claimed = [c for r in await index.claim(range(index.shards), 10, 30_000) for c in r.claimed]
        await asyncio.sleep(0.05)
    assert claimed, "nothing came due"
    [occ] = delivery.decode(delivery.encode(claimed))
    executor, webhooks, _ = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=0
    )
    failures = executor.settings.breaker_failures
    key = "ex|shared-api"
    long_ago = int(time.time() * 1000) - 600_000
    await index.report(
        [(key, False, None)] * failures, failures, 30_000, 3_600_000, now_ms=long_ago
    )
    try:
        live = await executor.hold([occ])
        await executor.process(live[0])
        await executor.drain()
    finally:
        await webhooks.close()
    # The refused one ended dead without going through the gate: the probe is still free.
    ((code, _, flags),) = await index.gate([(key, 0.0, 1, 10_000)], failures, 2000)
    assert (code, flags & 1) == (0, 1)


MISFIRE_POLICIES = [
    {"policy": "skip"},
    {"policy": "fire_once"},
    {"policy": "fire_all", "window_s": 30, "limit": 1},
]


async def began_then_died(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    sink: Sink,
    redis_prefix: str,
    misfire: dict[str, object],
) -> tuple[bytes, Occurrence]:
    """The delivery message of a one-fire schedule's occurrence whose executor began the
    delivery (it may have gone out) and died before completing it; by the time it returns,
    the occurrence and the next time of the rule are missed."""
    body = await claim_one(
        index,
        store,
        sink,
        spec={"kind": "interval", "every_s": 1, "max_fires": 1},
        misfire=misfire,
    )
    [occ] = delivery.decode(body)
    first, hooks, _ = await executor_with_clock(index, store, connection, redis_prefix, skew_s=0)
    try:
        assert await first.begin(occ) is not None
    finally:
        await hooks.close()
    # Past the grace of this occurrence and of the one after: judged now, every policy would
    # drop it for another time.
    await asyncio.sleep(2.3)
    return body, occ


async def deliver_message(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    redis_prefix: str,
    body: bytes,
) -> None:
    executor, hooks, audit = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=0
    )
    try:
        live = await executor.hold(delivery.decode(body))
        for occ in live:
            await executor.process(occ)
        await executor.drain()
        assert await audit.flush()
    finally:
        await hooks.close()


async def finished_with_one_fire(index: Index, store: Store, sink: Sink, occ: Occurrence) -> None:
    """What a user checks of a one-fire schedule: one occurrence at the target (its key), and
    nothing more to come."""
    assert [r.key for r in sink.received] == [schedule.idempotency_key("ex", "s", occ.nominal_ms)]
    due, lease, _ = await index.position(occ.shard, occ.member)
    assert (due, lease) == (None, None), "the schedule goes on past max_fires"
    [row] = await store.schedule_versions([("ex", "s")])
    assert (row.state, row.fires) == ("completed", 1)


@pytest.mark.parametrize("misfire", MISFIRE_POLICIES, ids=lambda m: str(m["policy"]))
async def test_a_redelivered_message_delivers_again_what_a_dead_executor_began(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    sink: Sink,
    redis_prefix: str,
    misfire: dict[str, object],
) -> None:
    """The broker hands the message of an executor killed mid-delivery to another: judging
    the occurrence missed would move on to a later time without counting the fire that may
    have gone out (max_fires 1 would fire twice). It goes again instead, with the same key."""
    body, occ = await began_then_died(index, store, connection, sink, redis_prefix, misfire)
    await deliver_message(index, store, connection, redis_prefix, body)
    await finished_with_one_fire(index, store, sink, occ)


@pytest.mark.parametrize("misfire", MISFIRE_POLICIES, ids=lambda m: str(m["policy"]))
async def test_a_reclaimed_lease_delivers_again_what_a_dead_executor_began(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    sink: Sink,
    redis_prefix: str,
    misfire: dict[str, object],
) -> None:
    """The same, when the lease runs out instead and the sweeper hands the occurrence out
    again in a new message."""
    _, occ = await began_then_died(index, store, connection, sink, redis_prefix, misfire)
    far = int(time.time() * 1000) + 3_600_000
    assert (await index.reclaim(range(index.shards), 10, now_ms=far))[occ.shard] == (1, 0)
    claimed = [
        c for r in await index.claim(range(index.shards), 10, 30_000, now_ms=far) for c in r.claimed
    ]
    assert [c.member for c in claimed] == [occ.member]
    await deliver_message(index, store, connection, redis_prefix, delivery.encode(claimed))
    await finished_with_one_fire(index, store, sink, occ)


async def test_an_occurrence_judged_skipped_by_a_dead_executor_is_judged_again_not_delivered(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    sink: Sink,
    redis_prefix: str,
) -> None:
    """The first executor began a missed occurrence and judged it (skip: not delivered), then
    died before its completion landed. Nothing went out, so the copy that takes it over
    judges it again and skips it too: a late delivery would break skip's promise."""
    body = await claim_one(
        index,
        store,
        sink,
        spec={"kind": "interval", "every_s": 1, "max_fires": 3},
        misfire={"policy": "skip"},
    )
    [occ] = delivery.decode(body)
    await asyncio.sleep(1.3)  # past the grace: missed
    cutoff = settle.misfire_cutoff(occ)
    assert cutoff is not None
    _, codes = await index.begin({occ.shard: [(occ.member, occ.token, 30_000, cutoff)]})
    assert codes == {occ.shard: [3]}  # judged missed, not flagged as begun
    await deliver_message(index, store, connection, redis_prefix, body)
    assert sink.received == []
    due, _, state = await index.position(occ.shard, occ.member)
    assert due is not None and state is not None and int(state.split("|")[0]) > occ.nominal_ms


@pytest.mark.parametrize("misfire", MISFIRE_POLICIES[1:], ids=lambda m: str(m["policy"]))
async def test_a_missed_occurrence_its_policy_delivers_is_delivered_again_after_a_takeover(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    sink: Sink,
    redis_prefix: str,
    misfire: dict[str, object],
) -> None:
    """Missed when begun, but its policy (fire_once, fire_all) delivers it all the same: it
    is flagged as begun before it goes, so when its executor dies mid-delivery the copy that
    takes over delivers it again (same key) rather than judging it anew and catching up a
    later time as well (two fires of a one-fire schedule)."""
    sink.delay_s = 2.0
    body = await claim_one(
        index,
        store,
        sink,
        spec={"kind": "interval", "every_s": 1, "max_fires": 1},
        misfire=misfire,
    )
    [occ] = delivery.decode(body)
    await asyncio.sleep(1.3)  # this occurrence is missed, the next one not yet
    first, hooks, _ = await executor_with_clock(index, store, connection, redis_prefix, skew_s=0)
    try:
        [live] = await first.hold([occ])
        delivering = asyncio.create_task(first.process(live))
        assert await sink.wait_for(lambda found: bool(found.received), 5), "nothing went out"
        delivering.cancel()  # the executor dies mid-delivery
        with contextlib.suppress(asyncio.CancelledError):
            await delivering
    finally:
        await hooks.close()
    await asyncio.sleep(1.2)  # the next time is missed too by now
    sink.delay_s = 0.0
    await deliver_message(index, store, connection, redis_prefix, body)
    key = schedule.idempotency_key("ex", "s", occ.nominal_ms)
    assert {r.key for r in sink.received} == {key}
    due, lease, _ = await index.position(occ.shard, occ.member)
    assert (due, lease) == (None, None), "the schedule goes on past max_fires"
