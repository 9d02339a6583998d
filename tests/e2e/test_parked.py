"""Deliveries held behind a closed gate are parked once, and delayed, never lost: delivered
after the breaker's cooldown even when the executor is killed (SIGKILL) while they are parked;
a pause while parked is honoured; a change of target while parked is delivered at once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aioredis

from cronbus.cli.sink import Received, Sink
from shared.contract import keys, timefmt
from tests.e2e.test_operations import metric_sum, webhook
from tests.support import services
from tests.support.commands import CommandClient
from tests.support.stack import Stack

SHARDS = 4
HELD = 12
FAST_BREAKER = {
    "CRONBUS_BREAKER_FAILURES": "3",
    "CRONBUS_BREAKER_COOLDOWN_S": "4",
    # An executor killed mid-delivery: its leases come back soon.
    "CRONBUS_LEASE_S": "4",
}


async def parked_now(redis_url: str, prefix: str) -> int:
    """Occurrences parked behind any rate key, over every shard."""
    client = aioredis.Redis.from_url(redis_url)
    names = keys.RedisKeys(prefix)
    try:
        total = 0
        for shard in range(SHARDS):
            for rate_key in await client.zrange(names.parked(shard), 0, -1):
                name = rate_key.decode() if isinstance(rate_key, bytes) else str(rate_key)
                total += await client.zcard(names.parked_on(shard, name))
        return total
    finally:
        await client.aclose()


async def until(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.2)  # another process's state: nothing to wait on
    return False


async def upsert_held(
    client: CommandClient, sink: Sink, due_ms: int, target: dict[str, Any] | None = None
) -> None:
    schedules = [
        {
            "id": f"held{i}",
            "spec": {"kind": "once", "at": timefmt.format_ms(due_ms)},
            "target": target or webhook(sink, "/down", rate_key="down-api"),
            "retry": {"max_attempts": 20, "initial_backoff_s": 0.2, "full_jitter": False},
            # Judged late twice, `skip` would drop it: a parked occurrence must not be.
            "misfire": {"policy": "skip"},
        }
        for i in range(HELD)
    ]
    reply = await client.send("acme", "upsert_many", {"schedules": schedules})
    assert reply["ok"] and all(r["ok"] for r in reply["results"]), reply


def delivered_ok(sink: Sink) -> set[str]:
    return {r.schedule for r in sink.received if r.status == 200}


async def open_breaker_and_park(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    prefix: str,
    parked: int = HELD // 2,
    env: dict[str, str] = FAST_BREAKER,
) -> int:
    """Every delivery fails until the breaker of ``down-api`` is open and some are parked;
    returns their due time."""
    sink.respond = lambda _: 500
    await stack.start_all(("dispatcher", "executor", "sweeper"), **env)
    due_ms = (int(time.time()) + 2) * 1000
    await upsert_held(client, sink, due_ms)
    assert await until(lambda: _parked_at_least(endpoints.redis_url, prefix, parked), 30), (
        stack.tails()
    )
    return due_ms


async def _parked_at_least(url: str, prefix: str, count: int) -> bool:
    return await parked_now(url, prefix) >= count


async def test_held_behind_an_open_breaker_is_delivered_after_the_cooldown_despite_a_kill(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
) -> None:
    await open_breaker_and_park(stack, sink, client, endpoints, redis_prefix)
    (executor,) = stack.running("executor")
    stack.kill(executor)  # SIGKILL while they are parked
    await asyncio.to_thread(executor.popen.wait, 10)
    sink.respond = lambda _: 200
    await stack.wait_ready(stack.start("executor", **FAST_BREAKER))
    assert await sink.wait_for(lambda s: len(delivered_ok(s)) >= HELD, timeout_s=60), stack.tails()
    assert delivered_ok(sink) == {f"acme/held{i}" for i in range(HELD)}
    # Delayed, not re-polled: each occurrence held a handful of times at most, not once per
    # look at a closed gate.
    (text,) = [(await asyncio.to_thread(p.get, "/metrics"))[1] for p in stack.running("executor")]
    print("held after the restart:", metric_sum(text, "cronbus_rate_held_total"))
    assert metric_sum(text, "cronbus_rate_released_total") >= 1


async def test_a_pause_while_parked_is_honoured(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
) -> None:
    await open_breaker_and_park(stack, sink, client, endpoints, redis_prefix)
    reply = await client.send("acme", "pause", {"id": "held0"})
    assert reply["ok"], reply
    # A delivery in flight when the pause was answered may still land just after it.
    paused_at_ms = time.time() * 1000 + 500
    sink.respond = lambda _: 200
    others = {f"acme/held{i}" for i in range(1, HELD)}
    assert await sink.wait_for(lambda s: others <= delivered_ok(s), timeout_s=60), stack.tails()
    await asyncio.sleep(2)
    after_pause: list[Received] = [
        r for r in sink.received if r.schedule == "acme/held0" and r.at_ms > paused_at_ms
    ]
    assert after_pause == [], after_pause


async def test_a_change_of_target_while_parked_is_delivered_at_once(
    stack: Stack,
    sink: Sink,
    client: CommandClient,
    endpoints: services.Endpoints,
    redis_prefix: str,
) -> None:
    # The breaker of down-api stays open a minute: what is parked behind it would wait that
    # long (and its safety deadline far longer) were the change of target not to release it.
    slow_breaker = {**FAST_BREAKER, "CRONBUS_BREAKER_COOLDOWN_S": "60"}
    due_ms = await open_breaker_and_park(
        stack, sink, client, endpoints, redis_prefix, parked=HELD, env=slow_breaker
    )
    sink.respond = lambda request: 200 if request.path.startswith("/up") else 500
    moved_at_ms = time.time() * 1000
    await upsert_held(client, sink, due_ms, target=webhook(sink, "/up"))
    everyone = {f"acme/held{i}" for i in range(HELD)}
    assert await sink.wait_for(lambda s: everyone <= delivered_ok(s), timeout_s=10), (
        sorted(delivered_ok(sink)),
        stack.tails(),
    )
    moved = [r for r in sink.received if r.status == 200]
    assert all(r.path.startswith("/up") and r.at_ms >= moved_at_ms for r in moved)
