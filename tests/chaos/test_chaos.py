"""Chaos: processes killed at random moments, RabbitMQ restarted, Redis flushed, PostgreSQL
restarted, under schedules firing every second with ``fire_all``. After each, every nominal
occurrence in the test window has been delivered at least once, every duplicate carries the
same idempotency key, and the test prints lost and duplicate counts and the recovery time.

These tests run their own Redis, RabbitMQ and PostgreSQL servers (tests/support/private.py),
so flushing and restarting them touches nothing else.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis

from cronbus.cli.sink import Sink
from shared.contract import codec, keys, timefmt
from shared.policy import netpolicy
from shared.rules import compact, schedule
from tests.support import private, services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

SCHEDULES = 12
RNG = random.Random()


@pytest.fixture(scope="module")
def servers() -> Iterator[private.PrivateServices]:
    reason = private.available()
    if reason:
        pytest.fail(f"chaos tests need private servers: {reason}")
    with private.private_services() as found:
        yield found


@pytest.fixture
async def env(servers: private.PrivateServices) -> AsyncIterator[dict[str, str]]:
    vhost = services.unique("chaos-")
    servers.rabbit.add_vhost(vhost)
    database = services.unique("chaos_")
    yield {
        "CRONBUS_REDIS_URL": servers.redis.url,
        "CRONBUS_REDIS_PREFIX": services.unique("chaos"),
        "CRONBUS_AMQP_URL": services.with_vhost(servers.rabbit.url, vhost),
        "CRONBUS_DATABASE_URL": services.with_database(servers.postgres.url, database),
        "CRONBUS_SHARDS": "4",
        "CRONBUS_LEASE_S": "3",
        "CRONBUS_SWEEP_INTERVAL_S": "1",
        "CRONBUS_SHUTDOWN_GRACE_S": "5",
        "CRONBUS_DRIFT_CHECK_INTERVAL_S": "2",
        "CRONBUS_EVENTS": "none",
        "CRONBUS_WEBHOOK_ALLOWED_NETWORKS": netpolicy.LOOPBACK_NETWORKS,
        "CRONBUS_LOG_LEVEL": "INFO",
    }


@pytest.fixture
def stack(env: dict[str, str], tmp_path: Path) -> Iterator[Stack]:
    found = Stack(env, tmp_path)
    yield found
    found.stop_all()


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    # A slow target: deliveries are in flight when processes die.
    found = Sink(delay_s=0.05)
    await found.start()
    yield found
    await found.stop()


@dataclass
class Workload:
    """Schedules firing every second under fire_all, and what their deliveries must show."""

    namespace: str
    first: dict[str, int] = field(default_factory=dict)

    async def register(self, client: CommandClient, sink: Sink) -> None:
        for i in range(SCHEDULES):
            reply = await client.send(
                self.namespace,
                "upsert",
                {
                    "schedule": {
                        "id": f"c{i}",
                        "spec": {"kind": "interval", "every_s": 1},
                        "target": {"kind": "webhook", "url": f"{sink.url}/c{i}"},
                        "misfire": {"policy": "fire_all", "window_s": 3600, "limit": 10_000},
                        "retry": {"max_attempts": 20, "initial_backoff_s": 0.2, "max_backoff_s": 1},
                    }
                },
            )
            assert reply["ok"], reply
            self.first[f"c{i}"] = timefmt.parse_rfc3339_ms(reply["schedule"]["next_fires"][0])

    def expected(self, until_ms: int) -> set[tuple[str, int]]:
        return {
            (schedule_id, t)
            for schedule_id, first in self.first.items()
            for t in range(first, until_ms + 1, 1000)
        }

    def worst_lateness_s(self, sink: Sink, since_ms: int, until_ms: int) -> float:
        """The latest first delivery of an occurrence due in [since, until]: how long the
        fault held work back."""
        first: dict[tuple[str, int], float] = {}
        for request in sink.received:
            nominal = timefmt.parse_rfc3339_ms(request.fire_time)
            if since_ms <= nominal <= until_ms:
                key = (request.schedule, nominal)
                first[key] = min(first.get(key, request.at_ms), request.at_ms)
        return max(((at - nominal) / 1000 for (_, nominal), at in first.items()), default=0.0)

    def check(self, sink: Sink, until_ms: int) -> tuple[int, int]:
        """(lost, duplicates) for the nominal times up to ``until_ms``; wrong keys fail."""
        seen: dict[tuple[str, int], int] = {}
        for request in sink.received:
            namespace, _, schedule_id = request.schedule.partition("/")
            nominal = timefmt.parse_rfc3339_ms(request.fire_time)
            assert request.key == schedule.idempotency_key(namespace, schedule_id, nominal)
            if nominal <= until_ms:
                seen[(schedule_id, nominal)] = seen.get((schedule_id, nominal), 0) + 1
        expected = self.expected(until_ms)
        lost = len(expected - set(seen))
        duplicates = sum(count - 1 for key, count in seen.items() if key in expected)
        return lost, duplicates

    async def wait_complete(self, sink: Sink, until_ms: int, timeout_s: float) -> float:
        """Seconds until every occurrence up to ``until_ms`` has arrived."""
        started = time.monotonic()
        expected = self.expected(until_ms)

        def complete(s: Sink) -> bool:
            got = {
                (r.schedule.partition("/")[2], timefmt.parse_rfc3339_ms(r.fire_time))
                for r in s.received
            }
            return expected <= got

        await sink.wait_for(complete, timeout_s)
        return time.monotonic() - started


async def assert_not_ready(stack: Stack, names: tuple[str, ...], dependency: str) -> None:
    """While a dependency is down, the services that need it say so on /readyz."""
    for name in names:
        for proc in stack.running(name):
            status, body = await asyncio.to_thread(proc.get, "/readyz")
            assert status == 503, (name, status, body)
            assert codec.loads(body)[dependency] is False, (name, body)


async def run_scenario(
    name: str,
    stack: Stack,
    sink: Sink,
    env: dict[str, str],
    chaos: Callable[[], Awaitable[None]],
    executors: int = 2,
) -> None:
    await stack.start_all(("dispatcher", "sweeper"))
    for _ in range(executors):
        await stack.wait_ready(stack.start("executor"))
    workload = Workload(services.unique("ns").lower())
    async with CommandClient(env["CRONBUS_AMQP_URL"]) as client:
        await workload.register(client, sink)
    await asyncio.sleep(3)
    fault_at = time.monotonic()
    fault_start_ms = int(time.time() * 1000)
    await chaos()
    fault_s = time.monotonic() - fault_at
    fault_end_ms = int(time.time() * 1000)
    # Recovered: everything due by the end of the fault has been delivered.
    recovery_s = await workload.wait_complete(sink, fault_end_ms, timeout_s=90)
    # And firing goes on afterwards: the window extends a few seconds past the fault.
    await asyncio.sleep(4)
    until_ms = int(time.time() * 1000) - 1500
    await workload.wait_complete(sink, until_ms, timeout_s=30)
    await asyncio.sleep(1.5)  # late duplicates, if any, arrive meanwhile
    lost, duplicates = workload.check(sink, until_ms)
    total = len(workload.expected(until_ms))
    worst = workload.worst_lateness_s(sink, fault_start_ms, fault_end_ms)
    print(
        f"\nchaos {name}: occurrences {total}, lost {lost}, duplicates {duplicates}, "
        f"fault lasted {fault_s:.1f}s, all caught up {recovery_s:.1f}s after it, "
        f"worst lateness of an occurrence due during it {worst:.1f}s"
    )
    assert lost == 0, stack.tails()


async def test_executor_killed_at_random_moments(
    stack: Stack, sink: Sink, env: dict[str, str]
) -> None:
    async def chaos() -> None:
        for _ in range(4):
            await asyncio.sleep(RNG.uniform(0.2, 1.5))
            victim = RNG.choice(stack.running("executor"))
            stack.kill(victim, signal.SIGKILL)
            await stack.wait_ready(stack.start("executor"))

    await run_scenario("kill -9 executor x4", stack, sink, env, chaos)


async def test_dispatcher_killed_at_random_moments(
    stack: Stack, sink: Sink, env: dict[str, str]
) -> None:
    async def chaos() -> None:
        for _ in range(3):
            await asyncio.sleep(RNG.uniform(0.2, 1.5))
            stack.kill(stack.running("dispatcher")[0], signal.SIGKILL)
            await asyncio.sleep(RNG.uniform(0, 1))
            await stack.wait_ready(stack.start("dispatcher"))

    await run_scenario("kill -9 dispatcher x3", stack, sink, env, chaos)


async def test_sweeper_and_executor_killed(stack: Stack, sink: Sink, env: dict[str, str]) -> None:
    async def chaos() -> None:
        # The executors die holding leases; the sweeper dies too; the new sweeper reclaims.
        for proc in stack.running("executor"):
            stack.kill(proc, signal.SIGKILL)
        await asyncio.sleep(RNG.uniform(0.1, 0.8))
        stack.kill(stack.running("sweeper")[0], signal.SIGKILL)
        await asyncio.sleep(2)
        await stack.wait_ready(stack.start("sweeper"))
        await stack.wait_ready(stack.start("executor"))

    await run_scenario("kill -9 executors and sweeper", stack, sink, env, chaos)


async def test_rabbitmq_restarted(
    stack: Stack, sink: Sink, env: dict[str, str], servers: private.PrivateServices
) -> None:
    async def chaos() -> None:
        await asyncio.to_thread(servers.rabbit.stop_app)
        await asyncio.sleep(3)
        await assert_not_ready(stack, ("dispatcher", "executor"), "rabbitmq")
        await asyncio.to_thread(servers.rabbit.start_app)

    await run_scenario("rabbitmqctl stop_app/start_app", stack, sink, env, chaos)
    for name in ("dispatcher", "executor", "sweeper"):
        assert stack.running(name), f"{name} did not survive the broker restart"


async def test_redis_flushed(
    stack: Stack, sink: Sink, env: dict[str, str], servers: private.PrivateServices
) -> None:
    async def chaos() -> None:
        client = aioredis.Redis.from_url(servers.redis.url)
        try:
            await client.flushall()
        finally:
            await client.aclose()

    await run_scenario("FLUSHALL", stack, sink, env, chaos)
    client = aioredis.Redis.from_url(servers.redis.url)
    try:
        assert await client.get(f"{env['CRONBUS_REDIS_PREFIX']}:meta:epoch") is not None
    finally:
        await client.aclose()


async def stored_plans(client: aioredis.Redis, prefix: str) -> list[bytes]:
    redis_keys = keys.RedisKeys(prefix)
    found: list[bytes] = []
    for shard in range(4):
        values = (await client.hgetall(redis_keys.sched(shard))).values()
        found += [v for v in values if isinstance(v, bytes)]
    return found


async def test_a_rolling_upgrade_to_the_binary_form_and_a_rebuild_lose_nothing(
    stack: Stack, sink: Sink, env: dict[str, str], servers: private.PrivateServices
) -> None:
    """The upgrade docs/upgrading.md gives: services writing the JSON form (as versions
    before the binary form did) replaced one at a time by services writing the binary form,
    then the index rebuilt in place (its epoch deleted). Firing goes on throughout, and the
    rebuild leaves every schedule in Redis in the binary form."""
    env["CRONBUS_COMPACT_FORM"] = "json"
    prefix = env["CRONBUS_REDIS_PREFIX"]
    client = aioredis.Redis.from_url(servers.redis.url)

    async def chaos() -> None:
        before = await stored_plans(client, prefix)
        assert len(before) == SCHEDULES and all(compact.is_json(v) for v in before)
        for name in ("dispatcher", "executor", "executor", "sweeper"):
            old = stack.running(name)[0]
            await stack.wait_ready(stack.start(name, CRONBUS_COMPACT_FORM="binary"))
            assert await stack.stop(old) == 0, old.tail()
        assert await client.delete(keys.RedisKeys(prefix).epoch) == 1
        deadline = time.monotonic() + 60
        while await client.get(keys.RedisKeys(prefix).epoch) is None:
            assert time.monotonic() < deadline, stack.tails()
            await asyncio.sleep(0.2)

    try:
        await run_scenario("upgrade to the binary form", stack, sink, env, chaos)
        after = await stored_plans(client, prefix)
        assert len(after) == SCHEDULES and not any(compact.is_json(v) for v in after)
    finally:
        await client.aclose()


async def test_postgres_restarted(
    stack: Stack, sink: Sink, env: dict[str, str], servers: private.PrivateServices
) -> None:
    async def chaos() -> None:
        await asyncio.to_thread(servers.postgres.stop)
        await asyncio.sleep(3)  # deliveries go on meanwhile; execution rows wait in memory
        await assert_not_ready(stack, ("dispatcher", "sweeper"), "postgres")
        await asyncio.to_thread(servers.postgres.start)

    await run_scenario("PostgreSQL stop/start", stack, sink, env, chaos)
    await asyncio.sleep(2)
    conn = await asyncpg.connect(env["CRONBUS_DATABASE_URL"])
    try:
        rows = await conn.fetchval("SELECT count(*) FROM executions WHERE status = 'succeeded'")
    finally:
        await conn.close()
    # The rows buffered while PostgreSQL was down were written once it came back.
    delivered = {(r.schedule, r.fire_time) for r in sink.received}
    assert rows >= len(delivered) - SCHEDULES * 2
    for name in ("dispatcher", "executor", "sweeper"):
        assert stack.running(name), f"{name} did not survive the PostgreSQL restart"


async def test_sigterm_under_load_loses_nothing_and_leaves_no_lease(
    stack: Stack, sink: Sink, env: dict[str, str]
) -> None:
    """Each service stops cleanly on SIGTERM while firing; with no sweeper running (and a
    lease far longer than the test), every occurrence is still delivered and no lease is
    left: whatever a stopping service held was finished or handed back by itself."""
    env["CRONBUS_LEASE_S"] = "120"
    for name in ("dispatcher", "executor", "executor"):
        await stack.wait_ready(stack.start(name))
    workload = Workload(services.unique("ns").lower())
    async with CommandClient(env["CRONBUS_AMQP_URL"]) as client:
        await workload.register(client, sink)
    sink.delay_s = 0.3  # deliveries are in flight when the signal comes
    await asyncio.sleep(3)
    first, second = stack.running("executor")
    assert await stack.stop(first) == 0, first.tail()
    await asyncio.sleep(2)
    dispatcher = stack.running("dispatcher")[0]
    # Claiming stops at the signal; the exit may come later (a loaded machine), so what
    # had to fire is what came due before the signal.
    stopped_ms = int(time.time() * 1000)
    assert await stack.stop(dispatcher) == 0, dispatcher.tail()
    sweeper = stack.start("sweeper")
    await stack.wait_ready(sweeper)
    assert await stack.stop(sweeper) == 0, sweeper.tail()
    # Everything the dispatcher claimed before it stopped is delivered by the other executor.
    recovery_s = await workload.wait_complete(sink, stopped_ms - 1000, timeout_s=30)
    await asyncio.sleep(2)
    assert await stack.stop(second) == 0, second.tail()
    lost, duplicates = workload.check(sink, stopped_ms - 1000)
    redis = aioredis.Redis.from_url(env["CRONBUS_REDIS_URL"])
    try:
        leases = sum(
            [await redis.zcard(f"{env['CRONBUS_REDIS_PREFIX']}:{{{s}}}:lease") for s in range(4)]
        )
    finally:
        await redis.aclose()
    print(
        f"\nchaos SIGTERM each service: lost {lost}, duplicates {duplicates}, "
        f"leases left {leases}, drained {recovery_s:.1f}s after the dispatcher stopped"
    )
    assert lost == 0, stack.tails()
    assert leases == 0, stack.tails()
