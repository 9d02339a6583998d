"""cronbus on Redis Sentinel: a primary, its replica and three Sentinels started by the test;
the primary killed (kill -9) while schedules fire and commands flow, the replica promoted in a
few seconds. The services follow the new primary by themselves: none dies, firing goes on,
``fire_all`` loses no occurrence (duplicates are counted and printed, with how long the
failover held firing back)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvloop
from redis import exceptions as redis_errors

from cronbus.cli.sink import Sink
from shared.contract import keys
from shared.contract.entries import Upsert
from shared.redis import connection
from shared.redis.index import Index
from shared.rules import compact
from shared.rules.plan import IntervalRule, Plan, WebhookPlan
from shared.runtime.config import CommonSettings
from tests.support import failover, sentinel, services
from tests.support.commands import CommandClient
from tests.support.failover import Workload
from tests.support.stack import Stack

pytestmark = [pytest.mark.failover, pytest.mark.timeout(150)]

SCHEDULES = 12


@pytest.fixture
def group() -> Iterator[sentinel.SentinelGroup]:
    with sentinel.sentinel_group() as found:
        yield found


def sentinel_settings(group: sentinel.SentinelGroup) -> CommonSettings:
    return CommonSettings(
        redis_url=group.url,
        redis_sentinels=group.setting,
        redis_sentinel_master=sentinel.MASTER,
        redis_prefix=services.unique("sen"),
        shards=4,
    )


async def test_the_index_follows_a_failover_and_reloads_its_scripts(
    group: sentinel.SentinelGroup,
) -> None:
    settings = sentinel_settings(group)
    client = connection.connect(settings)
    found = Index(client, keys.RedisKeys(settings.redis_prefix), settings.shards)
    try:
        await found.load_scripts()
        plan = compact.encode(Plan(1, IntervalRule(60_000), WebhookPlan("http://127.0.0.1:9/x")))
        now = int(time.time() * 1000)
        upserts: dict[int, list[Upsert]] = {}
        for i in range(40):
            shard = found.shard_of("ns", f"s{i}")
            upserts.setdefault(shard, []).append(Upsert(f"ns/s{i}", 1, plan, "keep", now - 5, ""))
        await found.upsert(upserts)
        assert await client.execute_command("WAIT", 1, 5000) == 1  # the replica has it all
        replica = group.replica()
        # The new primary must not know the scripts: the registry loads them on NOSCRIPT.
        sentinel._redis_cli(replica.port, "SCRIPT", "FLUSH")
        group.primary().kill()
        killed = time.monotonic()
        claimed = None
        while claimed is None and time.monotonic() - killed < 30:
            try:
                claimed = await found.claim(range(settings.shards), 1000, 30_000)
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                await asyncio.sleep(0.1)
        assert claimed is not None, "the index did not reach the new primary"
        assert sorted(c.member for r in claimed for c in r.claimed) == sorted(
            f"ns/s{i}" for i in range(40)
        )
        # The Sentinel asked first may learn of the failover a moment after the one the
        # client asked (they tell each other every second or two).
        for _ in range(50):
            if group.primary_port() == replica.port:
                break
            await asyncio.sleep(0.2)
        assert group.primary_port() == replica.port
        node = connection.connect_node(settings)
        try:
            assert (await node.info("server"))["tcp_port"] == replica.port
        finally:
            await node.aclose()
        print(
            f"\nsentinel: the index claimed from the new primary {time.monotonic() - killed:.1f}s"
        )
    finally:
        await client.aclose()


@dataclass
class Commands:
    """Commands sent all along (a new schedule every 0.2 s): each must end answered ok."""

    client: CommandClient
    namespace: str
    answered: list[float] = field(default_factory=list)
    refused: list[object] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set() and i < 400:
            sent = time.monotonic()
            reply = await self.client.send(
                self.namespace,
                "upsert",
                {
                    "schedule": {
                        "id": f"c{i}",
                        "spec": {"kind": "interval", "every_s": 3600},
                        "target": {"kind": "webhook", "url": "http://127.0.0.1:9/c"},
                    }
                },
            )
            if reply.get("ok"):
                self.answered.append(time.monotonic() - sent)
            else:
                self.refused.append(reply)
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


async def test_the_services_follow_a_failover_and_lose_nothing(
    group: sentinel.SentinelGroup,
    sink: Sink,
    amqp_url: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    env = failover.services_env(
        group.settings,
        services.unique("sen"),
        amqp_url,
        database_url,
        shards=4,
        sweep_interval_s=1,
    )
    stack = Stack(env, tmp_path)
    stop = asyncio.Event()
    try:
        await stack.start_all(("dispatcher", "executor", "sweeper"))
        workload = Workload(services.unique("ns").lower())
        async with CommandClient(amqp_url) as client:
            await workload.register(client, sink, SCHEDULES)
            commands = Commands(client, workload.namespace)
            flowing = asyncio.create_task(commands.run(stop))
            assert await sink.wait_for(lambda s: len(workload.delivered(s)) >= SCHEDULES * 2, 15), (
                stack.tails()
            )
            replica = group.replica()
            group.primary().kill()
            kill_ms = time.time() * 1000
            promoted_s = await asyncio.to_thread(group.wait_primary_is, replica.port, 30)

            # An occurrence due after the kill can only have been claimed from the new primary.
            def served_after_kill(s: Sink) -> bool:
                return any(d.nominal_ms > kill_ms for d in workload.deliveries(s))

            assert await sink.wait_for(served_after_kill, 30), stack.tails()
            first_ms = min(d.at_ms for d in workload.deliveries(sink) if d.nominal_ms > kill_ms)
            await asyncio.sleep(5)
            stop.set()
            await asyncio.wait_for(flowing, 40)
        until_ms = int(time.time() * 1000) - 1500
        expected = workload.expected(until_ms)
        await sink.wait_for(lambda s: expected <= workload.delivered(s), 40)
        await asyncio.sleep(1.5)  # late duplicates, if any, arrive meanwhile
        lost, duplicates = workload.check(sink, until_ms)
        for name in ("dispatcher", "executor", "sweeper"):
            assert len(stack.running(name)) == 1, f"{name} died:\n{stack.tails()}"
        slowest = max(commands.answered, default=0.0)
        print(
            f"\nsentinel failover: occurrences {len(expected)}, lost {lost}, duplicates "
            f"{duplicates}; Sentinel promoted the replica {promoted_s:.1f}s after the kill; first "
            f"occurrence due after the kill delivered {(first_ms - kill_ms) / 1000:.1f}s after it; "
            f"commands answered ok {len(commands.answered)}, refused {len(commands.refused)}, "
            f"slowest reply {slowest:.1f}s"
        )
        assert lost == 0, stack.tails()
        assert commands.refused == []
        assert len(commands.answered) >= 10
    finally:
        stop.set()
        stack.stop_all()


def test_a_sentinel_s_closed_connection_is_skipped(group: sentinel.SentinelGroup) -> None:
    # The Sentinels' own connections: a write on one the Sentinel closed is a ConnectionError,
    # which redis-py answers by asking the next Sentinel (uvloop's RuntimeError went through).
    async def case() -> None:
        client = connection.connect(sentinel_settings(group))
        assert isinstance(client, connection.SentinelRedis)
        assert client.sentinels is not None
        try:
            assert await client.ping()
            pooled = [
                conn
                for asked in client.sentinels.sentinels
                for conn in asked.connection_pool._available_connections
            ]
            pooled += client.connection_pool._available_connections
            for conn in pooled:
                assert conn._writer is not None
                conn._writer.transport.close()
            await asyncio.sleep(0.05)  # the loop tears the transports down
            assert await client.ping()
        finally:
            await client.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(case())
