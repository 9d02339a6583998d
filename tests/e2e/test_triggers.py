"""Triggers as a user sees them: durable across a Redis loss, a key of their own, no doubles."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from cronbus.cli.sink import Sink
from shared.contract import keys, timefmt
from shared.rules import schedule
from tests.support import services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

FAR_AWAY = "2099-01-01T00:00:00Z"


def idle(sink: Sink, schedule_id: str, timeout_s: float = 5) -> dict[str, Any]:
    """A schedule whose only runs are the triggers the test sends."""
    return {
        "id": schedule_id,
        "spec": {"kind": "once", "at": FAR_AWAY},
        "target": {"kind": "webhook", "url": f"{sink.url}/{schedule_id}", "timeout_s": timeout_s},
    }


async def lose_redis(endpoints: services.Endpoints, prefix: str) -> int:
    """Everything this test's cronbus holds in Redis is gone (a FLUSHALL of its corner)."""
    client = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        doomed = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if doomed:
            await client.delete(*doomed)
        return len(doomed)
    finally:
        await client.aclose()


async def query(database_url: str, sql: str) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(database_url)
    try:
        return [tuple(row) for row in await conn.fetch(sql)]
    finally:
        await conn.close()


async def nothing_pending(database_url: str) -> bool:
    return await query(database_url, "SELECT count(*) FROM pending_runs") == [(0,)]


async def wait_until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.2)
    return False


async def test_a_trigger_accepted_while_executors_are_down_survives_redis_losing_everything(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
    database_url: str,
) -> None:
    await stack.start_all(("dispatcher", "sweeper"))  # no executor: nothing is delivered yet
    assert (await client.send("acme", "upsert", {"schedule": idle(sink, "report")}))["ok"]
    triggered = await client.send("acme", "trigger", {"id": "report"})
    assert triggered["ok"], triggered
    key = triggered["trigger"]["idempotency_key"]
    fire_ms = timefmt.parse_rfc3339_ms(triggered["trigger"]["fire_time"])
    assert key == schedule.trigger_key("acme", "report", fire_ms)
    await asyncio.sleep(1)  # the dispatcher has claimed it and handed it to the broker

    assert await lose_redis(endpoints, redis_prefix) > 0
    epoch = keys.RedisKeys(redis_prefix).epoch
    redis = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        # The sweeper notices the loss and rebuilds the index from PostgreSQL.
        assert await wait_until(lambda: redis.exists(epoch), 20), stack.tails()
    finally:
        await redis.aclose()
    assert sink.received == []

    await stack.start_all(("executor",))
    assert await sink.wait_for(lambda s: len(s.received) >= 1, 20), stack.tails()
    await asyncio.sleep(2)  # anything delivered twice would have arrived by now
    delivered = sink.received[0]
    assert {r.key for r in sink.received} == {key}
    assert delivered.fire_time == triggered["trigger"]["fire_time"]
    assert delivered.headers["x-cronbus-trigger"] == "manual"
    # Completed: no longer pending, and recorded as the trigger it was.
    assert await wait_until(lambda: nothing_pending(database_url), 10)
    rows = await query(database_url, "SELECT is_trigger, idempotency_key, status FROM executions")
    assert rows == [(True, key, "succeeded")]
    # The copy claimed before the loss was still in the broker: its token is never minted
    # again (tokens never repeat), so it does not pass the fence.
    assert len(sink.received) == 1


async def test_a_replayed_trigger_whose_index_write_was_lost_is_delivered_once(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
) -> None:
    await stack.start_all(("dispatcher",))
    assert (await client.send("acme", "upsert", {"schedule": idle(sink, "nightly")}))["ok"]
    first = await client.send("acme", "trigger", {"id": "nightly"}, message_id="t-1")
    assert first["ok"], first
    # The intake "died" before its Redis write: the trigger is nowhere in the index.
    fire_ms = timefmt.parse_rfc3339_ms(first["trigger"]["fire_time"])
    member = keys.trigger_member("acme", "nightly", fire_ms)
    redis_keys = keys.RedisKeys(redis_prefix)
    shard = keys.shard_of("acme", "nightly", 4)
    redis = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        await redis.zrem(redis_keys.due(shard), member)
        await redis.zrem(redis_keys.lease(shard), member)
        await redis.hdel(redis_keys.occ(shard), member)
    finally:
        await redis.aclose()
    # The broker redelivers the command: it is answered, and the trigger is put back.
    again = await client.send("acme", "trigger", {"id": "nightly"}, message_id="t-1")
    assert again["duplicate"] is True and again["trigger"] == first["trigger"]
    await stack.start_all(("executor",))
    assert await sink.wait_for(lambda s: len(s.received) >= 1, 15), stack.tails()
    await asyncio.sleep(1.5)
    assert [r.key for r in sink.received] == [first["trigger"]["idempotency_key"]]


async def test_a_trigger_herd_delivers_each_key_exactly_once(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    stack_env: dict[str, str],
    database_url: str,
) -> None:
    stack_env["CRONBUS_DRIFT_CHECK_INTERVAL_S"] = "1"  # drift repair runs all along
    await stack.start_all(("dispatcher", "executor", "executor", "sweeper"))
    ids = [f"h{i}" for i in range(20)]
    for schedule_id in ids:
        # A long timeout: on a busy machine the test's own sink may answer late, and a retry
        # after a timeout is a second delivery by design, not the duplicate looked for here.
        body = {"schedule": idle(sink, schedule_id, timeout_s=60)}
        assert (await client.send("herd", "upsert", body))["ok"]
    # 2,000 triggers at once: 100 on each schedule, many within one millisecond.
    gate = asyncio.Semaphore(200)

    async def trigger(schedule_id: str) -> dict[str, Any]:
        async with gate:
            return await client.send("herd", "trigger", {"id": schedule_id}, timeout_s=120)

    started = time.monotonic()
    replies = await asyncio.gather(*(trigger(ids[i % len(ids)]) for i in range(2000)))
    assert all(r["ok"] for r in replies), [r for r in replies if not r["ok"]][:3]
    promised = {r["trigger"]["idempotency_key"] for r in replies}
    assert len(promised) == 2000  # every trigger is a run of its own

    assert await sink.wait_for(lambda s: {r.key for r in s.received} >= promised, 120), (
        stack.tails()
    )
    drained_s = time.monotonic() - started
    await asyncio.sleep(3)  # a few sweeps more: anything handed out again would show
    seen = collections.Counter(r.key for r in sink.received)
    twice = {key: n for key, n in seen.items() if n > 1}
    print(f"trigger herd: 2000 triggers delivered in {drained_s:.1f} s, {len(twice)} twice")
    assert twice == {}
    assert set(seen) == promised
    assert all(r.attempt == 1 and r.headers["x-cronbus-trigger"] == "manual" for r in sink.received)
    assert await wait_until(lambda: nothing_pending(database_url), 10)


async def test_deleting_a_schedule_drops_its_pending_triggers(
    stack: Stack, sink: Sink, client: CommandClient, database_url: str
) -> None:
    await stack.start_all(("dispatcher",))  # no executor: the triggers stay pending
    for schedule_id in ("kept", "dropped"):
        assert (await client.send("acme", "upsert", {"schedule": idle(sink, schedule_id)}))["ok"]
        for _ in range(2):
            assert (await client.send("acme", "trigger", {"id": schedule_id}))["ok"]
    pending = "SELECT id, count(*) FROM pending_runs GROUP BY id ORDER BY id"
    assert await query(database_url, pending) == [("dropped", 2), ("kept", 2)]
    assert (await client.send("acme", "delete", {"id": "dropped"}))["ok"]
    assert await query(database_url, pending) == [("kept", 2)]
    await stack.start_all(("executor",))
    assert await sink.wait_for(lambda s: len(s.received) >= 2, 15), stack.tails()
    await asyncio.sleep(1.5)
    assert sorted(r.path for r in sink.received) == ["/kept", "/kept"]
    assert await wait_until(lambda: nothing_pending(database_url), 10)
