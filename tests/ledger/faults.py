"""The ledger's faults, each applied to private servers (tests/support/private.py) and to the
services of one stack, and timed: a fault window starts when the fault begins and ends when
what it broke is back (a service ready again, a dependency answering, a rebuild done).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from tests.ledger import oracle
from tests.ledger.sink import Sinks
from tests.support import private
from tests.support.stack import Stack

#: Every fault, in the order one pass applies them.
FAULTS = (
    "kill9-executor",
    "kill9-dispatcher",
    "kill9-sweeper",
    "redis-flushall",
    "trigger-durable",
    "redis-old-snapshot",
    "postgres-restart",
    "broker-restart",
    "retry-after-429",
    "host-down",
    "overload",
)
#: How long the other host refuses connections, and the ``ra`` targets answer 429 (s).
HOST_DOWN_S = 6.0
THROTTLE_S = 6.0
#: The long profile's pass adds these.
LONG_FAULTS = (*FAULTS, "redis-failover", "rabbitmq-node-failover")
#: How far behind the promoted replica of the failover fault is: from 0.1 s to longer than
#: the ledger's sweep interval (1 s), drawn each time.
FAILOVER_LAG_S = (0.1, 1.5)


def of_profile(minutes: float) -> tuple[str, ...]:
    """The faults of one pass: the short profile (0 minutes) or the long one."""
    return FAULTS if minutes <= 0 else LONG_FAULTS


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Kit:
    """What the faults act on, and the driver's hooks for the faults that need commands."""

    stack: Stack
    servers: private.PrivateServices
    prefix: str
    rng: random.Random
    #: Sends a few triggers (used while the executors are down).
    send_triggers: Callable[[], Awaitable[None]]
    #: Loads many schedules due at one instant and waits until they have been delivered.
    burst: Callable[[], Awaitable[None]]
    sinks: Sinks
    snapshot: Path | None = None
    #: Sends ``count`` commands at random moments within ``seconds`` (the run's calm).
    commands: Callable[[float, int], Awaitable[None]] | None = None

    async def redis(self) -> aioredis.Redis:
        return aioredis.Redis.from_url(self.servers.redis.url)

    async def take_snapshot(self) -> None:
        """SAVE an RDB of the index as it is now, for the old-snapshot fault later."""
        client = await self.redis()
        try:
            await client.save()
        finally:
            await client.aclose()
        directory = self.servers.redis.directory
        self.snapshot = directory / "ledger-old.rdb"
        shutil.copyfile(directory / "dump.rdb", self.snapshot)

    async def restart(self, name: str, pause_s: float = 0.0) -> None:
        """kill -9 one running process of a service, then start a new one and wait for it."""
        running = self.stack.running(name)
        if running:
            self.stack.kill(self.rng.choice(running), signal.SIGKILL)
        await asyncio.sleep(pause_s)
        await self.stack.wait_ready(self.stack.start(name), timeout_s=60)

    async def all_ready(self) -> None:
        for name in ("dispatcher", "executor", "sweeper"):
            for proc in self.stack.running(name):
                await self.stack.wait_ready(proc, timeout_s=90)

    async def flushall(self) -> None:
        client = await self.redis()
        try:
            await client.flushall()
        finally:
            await client.aclose()

    async def wait_rebuilt(self, timeout_s: float = 60) -> None:
        """Until the sweeper has rebuilt the index (the epoch is back)."""
        client = await self.redis()
        try:
            deadline = time.monotonic() + timeout_s
            while await client.get(f"{self.prefix}:meta:epoch") is None:
                if time.monotonic() > deadline:
                    raise AssertionError("the index was not rebuilt within the time allowed")
                await asyncio.sleep(0.2)
        finally:
            await client.aclose()


async def _kill_executor(kit: Kit) -> None:
    await kit.restart("executor", kit.rng.uniform(0, 1))


async def _kill_dispatcher(kit: Kit) -> None:
    await kit.restart("dispatcher", kit.rng.uniform(0, 1))


async def _kill_sweeper(kit: Kit) -> None:
    # The sweeper is away long enough for leases to expire without it.
    await kit.restart("sweeper", 2)


async def _redis_flushall(kit: Kit) -> None:
    await kit.flushall()
    await kit.wait_rebuilt()


async def _trigger_durable(kit: Kit) -> None:
    """Triggers accepted while no executor runs, then Redis loses everything: they must still
    be delivered (they are kept in PostgreSQL until they complete)."""
    executors = kit.stack.running("executor")
    for proc in executors:
        kit.stack.kill(proc, signal.SIGKILL)
    await kit.send_triggers()
    await kit.flushall()
    await kit.wait_rebuilt()
    for _ in executors:
        await kit.stack.wait_ready(kit.stack.start("executor"), timeout_s=60)


async def _redis_old_snapshot(kit: Kit) -> None:
    """Redis restarted from an RDB saved early in the run: the index goes back in time (with
    its epoch), while PostgreSQL moved on (deletes, resets, fires)."""
    assert kit.snapshot is not None, "take_snapshot() first"
    redis = kit.servers.redis
    await asyncio.to_thread(redis.stop)
    shutil.copyfile(kit.snapshot, redis.directory / "dump.rdb")
    await asyncio.to_thread(redis.start)
    await kit.all_ready()


async def _redis_failover(kit: Kit) -> None:
    """A failover to a replica that lags: the primary dies and the promoted server holds the
    index as it was ``lag`` seconds earlier, on a new server (a new run id), while commands
    answered during those seconds are in PostgreSQL. Emulated on the ledger's one server:
    its data saved, commands and firing for ``lag`` seconds, the server killed and started
    again from what was saved. The data cronbus then finds is what a promoted lagging replica
    gives it; Sentinel and Cluster themselves are exercised in tests/failover and
    tests/cluster, and the ledger keeps its one private Redis (its other faults restart it)."""
    lag_s = kit.rng.uniform(*FAILOVER_LAG_S)
    redis = kit.servers.redis
    client = await kit.redis()
    try:
        await client.save()
    finally:
        await client.aclose()
    replica = redis.directory / "ledger-replica.rdb"
    shutil.copyfile(redis.directory / "dump.rdb", replica)
    if kit.commands is not None:
        await kit.commands(lag_s, 4)
    else:
        await asyncio.sleep(lag_s)
    await asyncio.to_thread(redis.stop)
    shutil.copyfile(replica, redis.directory / "dump.rdb")
    await asyncio.to_thread(redis.start)
    await kit.all_ready()


async def _rabbitmq_node_failover(kit: Kit) -> None:
    """The node every service is connected to is lost: the broker closes every connection, and
    the services move to the next node of CRONBUS_AMQP_URL (the ledger's one node under a
    second name) with their consumers. Killing a node of a real cluster is
    tests/failover/test_rabbitmq_cluster.py; the ledger keeps its one private broker."""
    await asyncio.to_thread(kit.servers.rabbit.close_connections)
    await kit.all_ready()


async def _postgres_restart(kit: Kit) -> None:
    await asyncio.to_thread(kit.servers.postgres.stop)
    await asyncio.sleep(2)
    await asyncio.to_thread(kit.servers.postgres.start)
    await kit.all_ready()


async def _broker_restart(kit: Kit) -> None:
    await asyncio.to_thread(kit.servers.rabbit.stop_app)
    await asyncio.sleep(2)
    await asyncio.to_thread(kit.servers.rabbit.start_app)
    await kit.all_ready()


async def _overload(kit: Kit) -> None:
    await kit.burst()


async def _retry_after_429(kit: Kit) -> None:
    """The ``ra`` targets answer 429 with Retry-After for a while: each answer holds the
    main host's rate key (every schedule on it), and enough of them open its breaker."""
    kit.sinks.throttling = True
    try:
        await asyncio.sleep(THROTTLE_S)
    finally:
        kit.sinks.throttling = False


async def _host_down(kit: Kit) -> None:
    """The other host refuses connections for a while: its breaker opens, its schedules are
    held (delayed, never lost), the main host's are not touched."""
    await kit.sinks.other_down()
    try:
        await asyncio.sleep(HOST_DOWN_S)
    finally:
        await kit.sinks.other_up()


ACTIONS: dict[str, Callable[[Kit], Awaitable[None]]] = {
    "kill9-executor": _kill_executor,
    "kill9-dispatcher": _kill_dispatcher,
    "kill9-sweeper": _kill_sweeper,
    "redis-flushall": _redis_flushall,
    "trigger-durable": _trigger_durable,
    "redis-old-snapshot": _redis_old_snapshot,
    "postgres-restart": _postgres_restart,
    "broker-restart": _broker_restart,
    "overload": _overload,
    "retry-after-429": _retry_after_429,
    "host-down": _host_down,
    "redis-failover": _redis_failover,
    "rabbitmq-node-failover": _rabbitmq_node_failover,
}


async def apply(name: str, kit: Kit) -> oracle.Fault:
    """Apply one fault; its window runs from the start until what it broke is back."""
    started = now_ms()
    await ACTIONS[name](kit)
    scope = kit.sinks.other_scope if name == "host-down" else ""
    return oracle.Fault(name, started, now_ms(), scope)
