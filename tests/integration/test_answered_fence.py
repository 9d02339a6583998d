"""Invariant 9 with several dispatchers: the one holding a shard fences its claims with a
position another dispatcher's intake answered within milliseconds of the answer (a
notification at the commit that marks it answered), not at its next read of the table. A
failover undoing that command takes longer than that, so no dispatcher claims from the index
it left behind."""

from __future__ import annotations

import asyncio
import contextlib
import time

from services.dispatcher.fence import Fence
from shared.postgres import positions
from shared.postgres.store import Store

#: Far longer than the test: only a notification can raise the fence in time.
SLOW_READ_S = 60.0
#: How soon the fence must know of an answer another intake gave.
NOTIFIED_WITHIN_S = 0.5


async def answer(store: Store, shard: int) -> int:
    """What an intake does: take a position in a transaction, then mark it answered."""
    async with store.transaction() as conn:
        taken = await positions.take(conn, [("ns", "no-such-schedule", shard)])
    await positions.mark_answered(store.pool, taken)
    return taken[shard]


async def wait_for(fence: Fence, shard: int, position: int, within_s: float) -> float:
    started = time.monotonic()
    while fence.answered.get(shard, 0) < position:
        assert time.monotonic() - started < within_s, (
            f"shard {shard}: answered position {position} not known to the fence after "
            f"{within_s}s (it knows {fence.answered.get(shard, 0)})"
        )
        await asyncio.sleep(0.005)
    return time.monotonic() - started


async def test_a_fence_learns_of_positions_another_intake_answered_at_once(store: Store) -> None:
    fence, stopping = Fence(), asyncio.Event()
    following = asyncio.create_task(fence.follow(store.pool, SLOW_READ_S, stopping))
    try:
        await asyncio.wait_for(fence.known.wait(), 5)
        for shard in (0, 3, 3, 7):
            position = await answer(store, shard)
            await wait_for(fence, shard, position, NOTIFIED_WITHIN_S)
    finally:
        stopping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(following, 5)


async def test_a_fence_listens_again_after_losing_its_connection(store: Store) -> None:
    fence, stopping = Fence(), asyncio.Event()
    following = asyncio.create_task(fence.follow(store.pool, 0.2, stopping))
    try:
        await asyncio.wait_for(fence.known.wait(), 5)
        # Every other connection of this database dropped: the listening one among them.
        await store.pool.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        await asyncio.sleep(1.0)  # a read or two: the listener is taken again
        position = await answer(store, 5)
        # Well inside one read of the table at 0.2 s would not prove the notification; the
        # point here is that the fence keeps up after the loss, by either path.
        await wait_for(fence, 5, position, NOTIFIED_WITHIN_S)
    finally:
        stopping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(following, 5)


def test_the_notification_payloads_round_trip_under_postgresqls_limit() -> None:
    for sent in ({0: 1, 12: 99, 3: 4_000_000_000}, {s: 10**12 + s for s in range(1024)}):
        payloads = positions.answered_payloads(sent)
        assert all(len(p.encode()) < 8000 for p in payloads), [len(p) for p in payloads]
        received: dict[int, int] = {}
        for payload in payloads:
            received.update(positions.parse_answered(payload))
        assert received == sent
    assert positions.parse_answered("junk,1:x,2:3,:4") == {2: 3}


async def test_a_batch_across_every_shard_is_answered_and_heard(store: Store) -> None:
    """1024 shards (the most CRONBUS_SHARDS allows) at large positions: one notification of
    them all would pass PostgreSQL's 8000-byte limit and fail the answer."""
    fence, stopping = Fence(), asyncio.Event()
    following = asyncio.create_task(fence.follow(store.pool, SLOW_READ_S, stopping))
    try:
        await asyncio.wait_for(fence.known.wait(), 5)
        sent = {shard: 10**12 + shard for shard in range(1024)}
        await positions.mark_answered(store.pool, sent)
        await wait_for(fence, 1023, sent[1023], NOTIFIED_WITHIN_S)
        assert {s: fence.answered.get(s) for s in sent} == sent
    finally:
        stopping.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(following, 5)
