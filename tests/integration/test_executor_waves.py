"""A delivery message's occurrences go through the executor in waves (begun together,
delivered concurrently, settled together) against the real Redis, PostgreSQL and RabbitMQ:
what happens to the others when one of them fails, or when the message is cut off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from cronbus.cli.sink import Sink
from services.executor import settle
from services.executor.audit import AuditWriter
from services.executor.executor import Executor
from services.executor.targets import Webhooks
from shared.contract import codec, delivery, validation
from shared.contract.delivery import Occurrence
from shared.policy import netpolicy
from shared.postgres import bulk
from shared.postgres.store import Store
from shared.rabbitmq import amqp
from shared.redis.index import Index
from tests.integration.test_executor_decisions import executor_with_clock

IDS = ("a", "b", "c")


async def claim_message(
    index: Index,
    store: Store,
    sink: Sink,
    ids: tuple[str, ...],
    extra: dict[str, dict[str, Any]] | None = None,
) -> bytes:
    """One delivery message carrying one occurrence of each schedule (``<sink>/<id>``;
    ``extra``: more fields of some)."""
    lines = [
        codec.dumps(
            {
                "id": name,
                "spec": {"kind": "interval", "every_s": 2},
                "target": {"kind": "webhook", "url": f"{sink.url}/{name}"},
                **(extra or {}).get(name, {}),
            }
        )
        for name in ids
    ]
    result = await bulk.import_lines(
        lines,
        "wv",
        store,
        index,
        validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK),
        workers=1,
    )
    assert not result.refused
    claimed: list[Any] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(claimed) < len(ids):
        claimed += [
            c for r in await index.claim(range(index.shards), 10, 30_000) for c in r.claimed
        ]
        await asyncio.sleep(0.05)
    assert len(claimed) == len(ids), "not everything came due"
    return delivery.encode(sorted(claimed, key=lambda c: c.member))


class Harness:
    def __init__(
        self,
        executor: Executor,
        webhooks: Webhooks,
        audit: AuditWriter,
        channel: AbstractChannel,
        queue: AbstractQueue,
    ) -> None:
        self.executor = executor
        self.channel = channel
        self.webhooks = webhooks
        self.audit = audit
        self.queue = queue

    async def message(self, body: bytes) -> AbstractIncomingMessage:
        await self.channel.default_exchange.publish(
            aio_pika.Message(body), routing_key=self.queue.name
        )
        message = await self.queue.get(timeout=5)
        assert message is not None
        return message

    async def slots_settle(self) -> None:
        """Done callbacks (slots given back by ended or cancelled attempts) have run."""
        for _ in range(20):
            await asyncio.sleep(0.01)


@pytest.fixture
async def harness(
    index: Index, store: Store, connection: AbstractRobustConnection, redis_prefix: str
) -> AsyncIterator[Harness]:
    executor, webhooks, audit = await executor_with_clock(
        index, store, connection, redis_prefix, 0, concurrency=8
    )
    channel = await connection.channel()
    queue = await amqp.deliveries_queue_of(channel)
    yield Harness(executor, webhooks, audit, channel, queue)
    await webhooks.close()


async def completed(index: Index, occ: Occurrence) -> bool:
    """The occurrence was settled in Redis: the schedule moved on to its next one."""
    due, lease, _ = await index.position(occ.shard, occ.member)
    return lease is None and due is not None and due > occ.fire_ms


def received(sink: Sink, name: str) -> int:
    return sum(1 for r in sink.received if r.path == f"/{name}")


async def handle_and_check_all_but_b(
    harness: Harness, index: Index, sink: Sink, body: bytes
) -> None:
    """The message is handled with a bug hitting b: every delivery slot comes back, and the
    others are delivered once and settled as if b were not there (cut off mid-delivery they
    would go out again with the message's redelivery, which b's failure brings)."""
    executor = harness.executor
    await executor.handle(await harness.message(body))
    await harness.slots_settle()
    assert executor.fair_slots.free == executor.settings.concurrency, "a delivery slot leaked"
    for occ in delivery.decode(body):
        if occ.id != "b":
            assert received(sink, occ.id) == 1
            assert await completed(index, occ), f"{occ.id} delivered and never settled"


async def test_a_bug_judging_one_occurrence_loses_no_slot_and_the_others_still_go(
    index: Index,
    store: Store,
    sink: Sink,
    harness: Harness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = await claim_message(index, store, sink, IDS)
    real = settle.missed_choice

    def buggy(occ: Occurrence, now_ms: int) -> int | None:
        if occ.id == "b":
            raise RuntimeError("a bug hit once")
        return real(occ, now_ms)

    monkeypatch.setattr(settle, "missed_choice", buggy)
    await handle_and_check_all_but_b(harness, index, sink, body)


async def test_a_bug_settling_one_occurrence_leaves_the_others_in_flight_to_settle(
    index: Index,
    store: Store,
    sink: Sink,
    harness: Harness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = await claim_message(index, store, sink, IDS)
    # b ends first, alone in its wave; a and c are still being delivered when it settles.
    sink.delay_for = lambda request: 0.0 if request.path == "/b" else 0.3
    real = settle.settle

    def buggy(occ: Occurrence, *args: Any, **kwargs: Any) -> settle.Settlement:
        if occ.id == "b":
            raise RuntimeError("a bug hit once")
        return real(occ, *args, **kwargs)

    monkeypatch.setattr(settle, "settle", buggy)
    await handle_and_check_all_but_b(harness, index, sink, body)


async def test_a_wave_whose_retries_cannot_be_written_keeps_what_its_completions_wrote(
    index: Index,
    store: Store,
    sink: Sink,
    harness: Harness,
) -> None:
    body = await claim_message(index, store, sink, ("a", "b"))
    [a, _] = delivery.decode(body)
    executor = harness.executor
    arrived: list[str] = []
    both = asyncio.Event()

    async def deliver(occ: Occurrence, key: str) -> tuple[settle.Outcome, int, int]:
        # Both end together (one wave): a succeeds, b fails with attempts left.
        arrived.append(occ.id)
        if len(arrived) == 2:
            both.set()
        await both.wait()
        now = executor.now_ms()
        if occ.id == "b":
            return settle.Outcome(False, None, "refused", sent=False), now, now
        return settle.Outcome(True, 200, reached=True), now, now

    async def redis_gone(*args: Any, **kwargs: Any) -> Any:
        # Redis goes away as the wave is settled, and the executor is stopping.
        executor.stopping.set()
        raise ConnectionError("Redis went away")

    executor._deliver = deliver  # type: ignore[method-assign]
    executor.index.retry = redis_gone  # type: ignore[method-assign]
    try:
        await executor.handle(await harness.message(body))
    finally:
        del executor.index.retry
    assert await completed(index, a)
    # a is completed in Redis: its execution row and its rotation checkpoint are owed to
    # PostgreSQL (the redelivery finds it settled, and writes nothing for it).
    assert [r.id for r in harness.audit.rows] == ["a"], "a completed occurrence went unrecorded"
    assert [c.id for c in harness.audit.checkpoints] == ["a"]
    assert executor.holding() == 1  # b, handed back at shutdown
    again = await harness.queue.get(timeout=5)
    assert again is not None and again.body == body


async def test_a_pause_waiting_for_postgresql_holds_up_no_other_settlement(
    index: Index,
    store: Store,
    sink: Sink,
    harness: Harness,
) -> None:
    """Deliveries go on while PostgreSQL is away: a schedule whose failures pause it waits
    for PostgreSQL to pause it, and the others of its message are settled meanwhile (their
    leases would otherwise run out, and they would be delivered again)."""
    body = await claim_message(
        index,
        store,
        sink,
        IDS,
        {"b": {"pause_after_failures": 1, "retry": {"max_attempts": 1}}},
    )
    occurrences = delivery.decode(body)
    sink.respond = lambda request: 500 if request.path == "/b" else 200
    sink.delay_for = lambda request: 0.0 if request.path == "/b" else 0.3
    executor = harness.executor
    back = asyncio.Event()
    real_pause = executor.autopause._pause_in_store

    async def postgres_away(occ: Occurrence, count: int) -> Any:
        if not back.is_set():
            raise asyncpg.CannotConnectNowError("the database system is starting up")
        return await real_pause(occ, count)

    executor.autopause._pause_in_store = postgres_away  # type: ignore[method-assign]
    task = asyncio.ensure_future(executor.handle(await harness.message(body)))
    try:
        others = [occ for occ in occurrences if occ.id != "b"]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if all([await completed(index, occ) for occ in others]):
                break
            await asyncio.sleep(0.05)
        settled = [occ.id for occ in others if await completed(index, occ)]
        assert settled == ["a", "c"], "one schedule's pause held up its neighbours' settlement"
    finally:
        back.set()
        await asyncio.wait_for(task, 10)
    row = await store.get_schedule("wv", "b")
    assert row is not None and row.state == "paused"


async def test_a_message_cut_off_mid_wave_gives_back_every_slot_and_claim(
    index: Index,
    store: Store,
    sink: Sink,
    harness: Harness,
) -> None:
    ids = tuple(f"s{i:02d}" for i in range(12))
    body = await claim_message(index, store, sink, ids)
    sink.delay_s = 0.5
    executor = harness.executor
    message = await harness.message(body)
    task = asyncio.ensure_future(executor.handle(message))

    def eight_arrived(found: Sink) -> bool:
        return len(found.received) >= 8

    assert await sink.wait_for(eight_arrived, 5)
    assert executor.fair_slots.free == 0
    task.cancel()  # the shutdown's grace period is over
    with pytest.raises(asyncio.CancelledError):
        await task
    await harness.slots_settle()
    assert executor.fair_slots.free == executor.settings.concurrency
    assert not executor.fair_slots._waiting
    assert not executor._waiting
    # The eight cut off are handed back at once; the four never begun are left to the
    # redelivery of the message (requeued).
    assert executor.holding() == 8
    assert await executor.release_abandoned() == 8
    again = await harness.queue.get(timeout=5)
    assert again is not None and again.body == body
    await again.ack()
    assert len(sink.received) == 8
