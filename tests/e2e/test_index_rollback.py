"""Invariant 9: a command answered ok is never undone by Redis.

80 schedules fire every second; then 20 are deleted, 20 paused, 20 moved to a new URL and 20
created, all answered ok; then the index is rolled back to a copy of every shard's keys taken
before those commands (DUMP before, RESTORE after, in one MULTI: what a failover to a replica
that lagged by the commands leaves behind; the epoch and its generation stay as they are, as on
a replica a couple of seconds behind). The oracle: no deleted or paused schedule fires an
occurrence after its reply (an occurrence already in flight then excepted), no moved one is
called at its old URL after its reply, and every created one is delivered on time and keeps
firing after the rollback.

Also: an index that belongs to another database (another deployment, same prefix) is never
fired: the services refuse to start, with one line naming the settings.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
import sys
import time
from typing import Any, cast

import asyncpg
import pytest
import redis.asyncio as aioredis

from cronbus.cli.sink import Received, Sink
from tests.support import services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

SCHEDULES = 80
GROUP = 20
#: A delivery arriving this long after the reply was in flight when it was sent, at most.
IN_FLIGHT_MS = 1500
#: A created schedule's first delivery comes within this long of its reply.
ON_TIME_MS = 3000


def every_second(sink: Sink, schedule_id: str, path: str) -> dict[str, Any]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": 1},
        "target": {"kind": "webhook", "url": f"{sink.url}{path}"},
    }


def every_second_fire_all(sink: Sink, schedule_id: str) -> dict[str, Any]:
    """Every occurrence owed, however late: the one in flight in the copy is delivered again
    with its own key."""
    return {
        **every_second(sink, schedule_id, f"/f/{schedule_id}"),
        "misfire": {"policy": "fire_all"},
    }


def fire_ms(request: Received) -> float:
    return dt.datetime.fromisoformat(request.fire_time).timestamp() * 1000


def after_reply(request: Received, reply_ms: float) -> bool:
    """Delivered for an occurrence the command should have stopped: one due after the reply,
    or one that arrived later than an occurrence in flight at the reply could have."""
    return fire_ms(request) > reply_ms or request.at_ms > reply_ms + IN_FLIGHT_MS


async def shard_keys(client: aioredis.Redis, prefix: str) -> list[bytes]:
    return [key async for key in client.scan_iter(match=f"{prefix}:{{*}}:*", count=1000)]


async def snapshot(client: aioredis.Redis, prefix: str) -> dict[bytes, bytes]:
    """Every shard key's DUMP (the meta keys, epoch included, are left out: a replica a few
    seconds behind has the same epoch and generation)."""
    found = await shard_keys(client, prefix)
    pipe = client.pipeline(transaction=False)
    for key in found:
        pipe.dump(key)
    dumps = await pipe.execute()
    return {key: dump for key, dump in zip(found, dumps, strict=True) if dump is not None}


def in_flight(saved: dict[bytes, bytes]) -> bool:
    """Whether a copy holds an occurrence in flight (a shard's lease set exists only while it
    has members)."""
    return any(key.endswith(b":lease") for key in saved)


async def fire_every_second(
    stack: Stack, sink: Sink, client: CommandClient, schedules: list[dict[str, Any]], **env: str
) -> None:
    """The services started with ``env``, the schedules created, and each delivered once."""
    await stack.start_all(("dispatcher", "executor", "sweeper"), **env)
    await send_all(client, [("upsert", {"schedule": body}) for body in schedules])
    paths = {body["target"]["url"].removeprefix(sink.url) for body in schedules}
    assert await sink.wait_for(lambda s: {r.path for r in s.received} >= paths, 20), (
        "not every schedule fired"
    )


async def snapshot_between_fires(client: aioredis.Redis, prefix: str) -> dict[bytes, bytes]:
    """A copy taken half way between two fires, at a moment no occurrence is in flight: each
    schedule waits in due, so the copy holds its next occurrence (due again by the time it is
    restored). An occurrence in flight in the copy is one whose completion the rollback
    undoes: the sweeper delivers it again once its lease expires (``CRONBUS_LEASE_S``), a
    cost of its own (see test_an_occurrence_in_flight_in_the_copy_is_delivered_again), not
    what the test of answered commands judges. On a loaded machine a fire may still be in
    flight at the half second: the next one is tried."""
    for _ in range(20):
        await asyncio.sleep(1.5 - (time.time() % 1.0))
        saved = await snapshot(client, prefix)
        if not in_flight(saved):
            return saved
    raise AssertionError("an occurrence was in flight at every half second for 20 s")


async def roll_back(client: aioredis.Redis, prefix: str, saved: dict[bytes, bytes]) -> None:
    """Every shard key back to the snapshot, at once."""
    now = await shard_keys(client, prefix)
    pipe = client.pipeline(transaction=True)
    if now:
        pipe.delete(*now)
    for key, dump in saved.items():
        pipe.restore(key, 0, dump, replace=True)
    await pipe.execute()


async def send_all(
    client: CommandClient, commands: list[tuple[str, dict[str, Any]]]
) -> list[float]:
    """Each command sent and answered ok; the time (ms) each reply arrived."""
    gate = asyncio.Semaphore(8)

    async def one(verb: str, body: dict[str, Any]) -> float:
        async with gate:
            reply = await client.send("roll", verb, body)
            assert reply["ok"], reply
            return time.time() * 1000

    return list(await asyncio.gather(*(one(v, b) for v, b in commands)))


async def positions_caught_up(database_url: str, client: aioredis.Redis, prefix: str) -> bool:
    conn = await asyncpg.connect(database_url)
    try:
        committed = {
            r["shard"]: r["committed"]
            for r in await conn.fetch("SELECT shard, committed FROM index_positions")
        }
    finally:
        await conn.close()
    for shard, position in committed.items():
        held = await client.get(f"{prefix}:{{{shard}}}:pos")
        if int(held or 0) < position:
            return False
    return True


@pytest.mark.parametrize("check_s", ["0.5", "3"])
async def test_an_index_rolled_back_never_undoes_an_answered_command(
    check_s: str,
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
    database_url: str,
) -> None:
    # The default check, and a slow one: until the sweeper's replay, the fence alone holds.
    ids = [f"s{i}" for i in range(SCHEDULES)]
    await fire_every_second(
        stack,
        sink,
        client,
        [every_second(sink, i, f"/old/{i}") for i in ids],
        CRONBUS_POSITION_CHECK_S=check_s,
    )
    redis = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        saved = await snapshot_between_fires(redis, redis_prefix)
        taken_at = time.monotonic()
        deleted, paused, moved = ids[:GROUP], ids[GROUP : 2 * GROUP], ids[2 * GROUP : 3 * GROUP]
        created = [f"c{i}" for i in range(GROUP)]
        commands: list[tuple[str, dict[str, Any]]] = (
            [("delete", {"id": i}) for i in deleted]
            + [("pause", {"id": i}) for i in paused]
            + [("upsert", {"schedule": every_second(sink, i, f"/new/{i}")}) for i in moved]
            + [("upsert", {"schedule": every_second(sink, i, f"/c/{i}")}) for i in created]
        )
        replies = dict(
            zip(
                deleted + paused + moved + created,
                await send_all(client, commands),
                strict=True,
            )
        )
        # The replica lagged by ~2 s: everything answered since the copy is lost.
        await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - taken_at)))
        await roll_back(redis, redis_prefix, saved)
        rolled_at = time.monotonic()
        rolled_ms = time.time() * 1000
        repaired_s = None
        while time.monotonic() - rolled_at < 10 + float(check_s):
            if await positions_caught_up(database_url, redis, redis_prefix):
                repaired_s = time.monotonic() - rolled_at
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(max(0.0, 6.0 + float(check_s) - (time.monotonic() - rolled_at)))
    finally:
        await redis.aclose()

    received = list(sink.received)
    unwanted = [
        (r.path, r.fire_time)
        for r in received
        for i in deleted + paused
        if r.path == f"/old/{i}" and after_reply(r, replies[i])
    ]
    old_url = [
        (r.path, r.fire_time)
        for r in received
        for i in moved
        if r.path == f"/old/{i}" and after_reply(r, replies[i])
    ]
    first = {
        i: min((r.at_ms for r in received if r.path == f"/c/{i}"), default=None) for i in created
    }
    late = {i: (at - replies[i]) if at else None for i, at in first.items()}
    after_rollback = {
        i
        for i in created + moved
        if any(r.at_ms > rolled_ms + 2000 and r.path.endswith(f"/{i}") for r in received)
    }
    print(
        f"\nunwanted fires {len(unwanted)}, old-URL calls {len(old_url)}, "
        f"created first delivered within {max(v or 1e9 for v in late.values()) / 1000:.2f} s, "
        f"repaired in {repaired_s} s (checks every {check_s} s)"
    )
    assert unwanted == [], unwanted
    assert old_url == [], old_url
    assert all(v is not None and v <= ON_TIME_MS for v in late.values()), late
    assert after_rollback == set(created + moved), set(created + moved) - after_rollback
    assert repaired_s is not None, "the index never caught up with PostgreSQL"


async def snapshot_in_flight(client: aioredis.Redis, prefix: str) -> dict[bytes, bytes]:
    """A copy taken while occurrences are in flight (claimed, not yet completed)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        saved = await snapshot(client, prefix)
        if in_flight(saved):
            return saved
        await asyncio.sleep(0.05)
    raise AssertionError("no occurrence was in flight in 20 s")


async def test_an_occurrence_in_flight_in_the_copy_is_delivered_again_and_its_schedule_goes_on(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
) -> None:
    # The copy holds occurrences in flight; their completions (and the next occurrences they
    # placed) are what the rollback undoes. Each is delivered again, with the same key, once
    # its lease expires, and its schedule fires on: late by about the lease, never stopped.
    sink.delay_s = 0.4  # deliveries take a while: the copy catches some in flight
    ids = [f"f{i}" for i in range(10)]
    await fire_every_second(
        stack,
        sink,
        client,
        [every_second_fire_all(sink, i) for i in ids],
        CRONBUS_LEASE_S="4",
        CRONBUS_SWEEP_INTERVAL_S="0.5",
    )
    redis = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        saved = await snapshot_in_flight(redis, redis_prefix)
        deadlines = {
            member.decode().rsplit("/", 1)[-1]: deadline
            for key, dump in saved.items()
            if key.endswith(b":lease")
            for member, deadline in await _members_of(redis, redis_prefix, dump)
        }
        # Every delivery in flight in the copy completes (and places its next occurrence).
        await asyncio.sleep(1.5)
        await roll_back(redis, redis_prefix, saved)
        rolled_ms = time.time() * 1000
        # The leases in the copy expire (the lease and the delivery's own timeout after the
        # claim), the sweeper takes them back within a sweep, and each schedule fires on.
        expired_ms = max(deadlines.values())
        await asyncio.sleep(max(0.0, (expired_ms - rolled_ms) / 1000) + 8)
    finally:
        await redis.aclose()

    received = list(sink.received)
    again = {
        r.path.rsplit("/", 1)[-1]
        for r in received
        if r.at_ms > rolled_ms and sum(o.key == r.key for o in received) > 1
    }
    going_on = {
        i for i in ids if any(r.at_ms > expired_ms + 2000 and r.path == f"/f/{i}" for r in received)
    }
    leased = set(deadlines)
    print(
        f"\nin flight in the copy: {len(leased)}, delivered again: {len(again)}, "
        f"stalled for {(expired_ms - rolled_ms) / 1000:.1f} s after the rollback"
    )
    assert leased, "the copy held no occurrence in flight"
    assert leased <= again, leased - again
    assert going_on == set(ids), set(ids) - going_on


async def _members_of(
    client: aioredis.Redis, prefix: str, dump: bytes
) -> list[tuple[bytes, float]]:
    """The members and scores of a sorted set from its DUMP, read back through a scratch
    key."""
    scratch = f"{prefix}:test-scratch"
    await client.restore(scratch, 0, dump)
    try:
        # Without decode_responses, members come back as bytes.
        return cast(list[tuple[bytes, float]], await client.zrange(scratch, 0, -1, withscores=True))
    finally:
        await client.delete(scratch)


async def test_an_index_of_another_database_is_refused_at_start(
    stack_env: dict[str, str], endpoints: services.Endpoints, redis_prefix: str
) -> None:
    redis = aioredis.Redis.from_url(endpoints.redis_url)
    try:
        await redis.set(f"{redis_prefix}:meta:database", "7000000000000000001/elsewhere")
        await redis.set(f"{redis_prefix}:meta:epoch", "3")
        await redis.hset(f"{redis_prefix}:{{0}}:sched", "x/y", b'{"v":1}')
        for service in ("dispatcher", "executor", "sweeper"):
            result = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", f"services.{service}"],
                env={**os.environ, **stack_env, "CRONBUS_METRICS_PORT": "0"},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            naming = [
                line
                for line in result.stderr.splitlines()
                if "CRONBUS_REDIS_URL" in line and "CRONBUS_REDIS_PREFIX" in line
            ]
            assert result.returncode == 2, result.stderr
            assert len(naming) == 1 and naming[0].startswith(f"cronbus {service}: "), result.stderr
            assert "elsewhere" in naming[0] and "Traceback" not in result.stderr
            print(f"\n{naming[0]}")
        # Nothing of the other deployment's index was touched.
        assert await redis.hget(f"{redis_prefix}:{{0}}:sched", "x/y") == b'{"v":1}'
        assert await redis.get(f"{redis_prefix}:meta:epoch") == b"3"
    finally:
        await redis.aclose()
