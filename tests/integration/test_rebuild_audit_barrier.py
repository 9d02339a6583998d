"""A rebuild of a lost index reads PostgreSQL only once the live executors wrote what Redis
had acknowledged (the audit barrier): a one-fire schedule that finished in Redis while its
checkpoint still waited in an executor's audit buffer is not placed again, under any misfire
policy, so it fires once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
from aio_pika.abc import AbstractRobustConnection

from cronbus.cli.sink import Sink
from services.sweeper.sweeper import Sweeper
from shared.contract import delivery
from shared.postgres import barrier
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.runtime import metrics
from shared.runtime.config import SweeperSettings
from tests.integration.test_executor_decisions import (
    MISFIRE_POLICIES,
    claim_one,
    executor_with_clock,
    finished_with_one_fire,
)


def sweeper_of(index: Index, store: Store, redis_prefix: str, wait_s: float = 10) -> Sweeper:
    settings = SweeperSettings(
        redis_prefix=redis_prefix, shards=index.shards, rebuild_audit_wait_s=wait_s
    )
    return Sweeper(settings, index, store, asyncio.Event())


async def lose_the_index(index: Index) -> None:
    """What FLUSHALL does to this test's keys."""
    await index.wipe()
    await index.client.delete(index.keys.epoch)


@pytest.mark.parametrize("misfire", MISFIRE_POLICIES, ids=lambda m: str(m["policy"]))
async def test_a_rebuild_waits_for_a_finished_schedule_s_checkpoint_still_in_a_buffer(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    sink: Sink,
    redis_prefix: str,
    misfire: dict[str, object],
) -> None:
    body = await claim_one(
        index,
        store,
        sink,
        spec={"kind": "interval", "every_s": 1, "max_fires": 1},
        misfire=misfire,
    )
    [occ] = delivery.decode(body)
    # An executor that writes its audit rows only every ten minutes, unless asked.
    executor, hooks, audit = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=0, audit_flush_ms=600_000
    )
    stopping = asyncio.Event()
    writer = asyncio.create_task(audit.run(stopping))
    try:
        for live in await executor.hold([occ]):
            await executor.process(live)
        await executor.drain()
        # Finished in Redis; PostgreSQL does not know yet.
        assert audit.pending > 0
        [row] = await store.schedule_versions([("ex", "s")])
        assert (row.state, row.fires) == ("active", 0)
        await asyncio.sleep(2.3)  # the rule's next times are missed: a policy would move on
        await lose_the_index(index)
        await sweeper_of(index, store, redis_prefix).rebuild()
        await finished_with_one_fire(index, store, sink, occ)
    finally:
        stopping.set()
        with contextlib.suppress(Exception):
            await writer
        await audit.close(timeout_s=1)
        await hooks.close()


@pytest.mark.parametrize("misfire", MISFIRE_POLICIES, ids=lambda m: str(m["policy"]))
async def test_a_rebuild_waits_for_a_delivery_under_way_when_redis_lost_its_data(
    index: Index,
    store: Store,
    connection: AbstractRobustConnection,
    sink: Sink,
    redis_prefix: str,
    misfire: dict[str, object],
) -> None:
    """The occurrence is being delivered (a slow target) when the index is lost: its
    completion finds nothing to complete, yet the fire went out. The rebuild waits for it to
    settle, and its checkpoint counts it."""
    sink.delay_s = 3.0
    body = await claim_one(
        index,
        store,
        sink,
        spec={"kind": "interval", "every_s": 1, "max_fires": 1},
        misfire=misfire,
    )
    [occ] = delivery.decode(body)
    executor, hooks, audit = await executor_with_clock(
        index, store, connection, redis_prefix, skew_s=0, audit_flush_ms=600_000
    )
    stopping = asyncio.Event()
    writer = asyncio.create_task(audit.run(stopping))
    try:
        [live] = await executor.hold([occ])
        delivering = asyncio.create_task(executor.process(live))
        assert await sink.wait_for(lambda found: bool(found.received), 5), "nothing went out"
        await lose_the_index(index)
        started = time.monotonic()
        await sweeper_of(index, store, redis_prefix).rebuild()
        assert delivering.done(), "the rebuild read PostgreSQL before the delivery settled"
        assert time.monotonic() - started < 9
        await executor.drain()
        await finished_with_one_fire(index, store, sink, occ)
    finally:
        stopping.set()
        with contextlib.suppress(Exception):
            await writer
        await audit.close(timeout_s=1)
        await hooks.close()


async def test_a_rebuild_waits_no_longer_than_its_limit_for_an_executor_that_never_answers(
    index: Index, store: Store, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Alive (heard of just now) but frozen: it will not answer.
    await barrier.answer(store.pool, "frozen-executor", 0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        await sweeper_of(index, store, redis_prefix, wait_s=0.5).rebuild()
    waited = time.monotonic() - started
    assert 0.5 <= waited < 5
    assert any(
        getattr(r, "action", "") == "audit_barrier_timeout"
        and "frozen-executor" in getattr(r, "executors", [])
        for r in caplog.records
    )
    assert metrics.REBUILD_AUDIT_WAIT._value.get() >= 0.5
    assert await index.client.get(index.keys.epoch)  # the rebuild went on


async def test_a_rebuild_does_not_wait_for_an_executor_long_silent_or_stopped(
    index: Index, store: Store, redis_prefix: str
) -> None:
    await barrier.answer(store.pool, "dead-executor", 0)
    await store.pool.execute(
        "UPDATE audit_writers SET seen_at = now() - interval '6 seconds' WHERE writer = $1",
        "dead-executor",
    )
    await barrier.answer(store.pool, "stopped-executor", 0)
    await barrier.forget(store.pool, "stopped-executor")
    started = time.monotonic()
    await sweeper_of(index, store, redis_prefix, wait_s=30).rebuild()
    assert time.monotonic() - started < 4
