"""Rebuilding a lost index from PostgreSQL: one sweeper at a time under a renewed lock, the
highest priorities first, with a witness that notices Redis losing data while it runs.

The epoch is set only when every page was written to the same Redis servers that were there
when the rebuild started; anything else starts the rebuild over at the next check.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.lock import Lock

from services.sweeper import backfills, pending
from shared.contract.entries import Upsert
from shared.contract.rows import LiveSchedule
from shared.postgres import barrier
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.rules import rotation
from shared.runtime import metrics, transient
from shared.runtime.config import SweeperSettings
from shared.runtime.readahead import read_ahead

# The sweeper's log lines keep one logger name, whichever module writes them.
log = logging.getLogger("services.sweeper.sweeper")

#: The rebuild lock's time to live (s), and how often a running rebuild renews it.
REBUILD_LOCK_S = 60
REBUILD_LOCK_RENEW_S = 15.0
#: A rebuild's witness keys outlive any rebuild; an interrupted one's go by themselves.
REBUILD_WITNESS_TTL_S = 7 * 86_400
#: How often a rebuild looks whether the executors answered its audit barrier (s).
BARRIER_POLL_S = 0.05


class IndexLostDuringRebuild(Exception):
    """Redis lost data while a rebuild ran: what the rebuild wrote before may be gone, so the
    index is not complete and the epoch must stay unset (the next check rebuilds again)."""


#: What ends a rebuild early, to start over at the next check.
_REBUILD_INTERRUPTIONS: tuple[type[BaseException], ...] = (
    *transient.ERRORS,
    IndexLostDuringRebuild,
)


def group_by_shard(entries: Iterable[tuple[int, Upsert]]) -> dict[int, list[Upsert]]:
    grouped: dict[int, list[Upsert]] = defaultdict(list)
    for shard, entry in entries:
        grouped[shard].append(entry)
    return grouped


async def _cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Stop these tasks; the error being raised, if any, is the one that matters.

    asyncio.wait rather than an await of each: a cancellation of the caller meanwhile must
    not be taken for theirs and swallowed."""
    running = list(tasks)
    if not running:
        return
    for task in running:
        task.cancel()
    await asyncio.wait(running)
    for task in running:
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not report it as lost


def same_servers(before: frozenset[str] | None, after: frozenset[str] | None) -> bool:
    """Whether no Redis server restarted between the two reads (unknown: taken as none)."""
    return before is None or after is None or before == after


def _run_ids(info: object) -> frozenset[str] | None:
    """The run ids in an INFO reply: one server's, or node -> INFO of several (a cluster);
    None when there is none to read."""
    if not isinstance(info, dict):
        return None
    if "run_id" in info:
        return frozenset({str(info["run_id"])})
    found = frozenset(
        str(node["run_id"]) for node in info.values() if isinstance(node, dict) and "run_id" in node
    )
    return found or None


def entry_of(row: LiveSchedule, now_ms: int) -> Upsert | None:
    return rotation.index_entry(
        row.namespace,
        row.id,
        row.state,
        row.compact,
        row.fires,
        row.last_fire_ms,
        row.next_fire_ms,
        now_ms,
    )


@dataclasses.dataclass
class RedisClock:
    """The Redis clock, read again every ``REREAD_S`` and run forward on this host's
    monotonic clock in between: a read per page would queue behind the write of the page
    before it, in Redis's single thread, and undo the overlap of the two."""

    REREAD_S: ClassVar[float] = 1.0
    redis_ms: int
    read_at: float

    @classmethod
    async def read(cls, sweeper: Rebuilding) -> RedisClock:
        return cls(await sweeper.redis_now_ms(), time.monotonic())

    async def now_ms(self, sweeper: Rebuilding) -> int:
        elapsed = time.monotonic() - self.read_at
        if elapsed >= self.REREAD_S:
            self.redis_ms, self.read_at = await sweeper.redis_now_ms(), time.monotonic()
            return self.redis_ms
        return self.redis_ms + int(elapsed * 1000)


class Rebuilding:
    """The sweeper's rebuild and epoch checks (a part of ``Sweeper``)."""

    settings: SweeperSettings
    index: Index
    store: Store
    stopping: asyncio.Event
    clock: Callable[[], float]
    identity: str
    rebuilding: asyncio.Task[None] | None
    pending_repair: pending.PendingRepair
    backfill_repair: backfills.BackfillRepair

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    async def start_positions(self) -> None:
        """The positions a rebuild starts from (``services.sweeper.positions``)."""

    async def foreign_index(self) -> bool:
        """Whether the index belongs to another database (``services.sweeper.positions``)."""
        return False

    # --- rebuild ------------------------------------------------------------------------------

    async def redis_now_ms(self) -> int:
        """The Redis clock: every misfire decision uses it, never this host's."""
        seconds, micros = await self.index.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def _rebuild_running(self) -> bool:
        if self.rebuilding is not None and not self.rebuilding.done():
            return True
        return bool(await self.index.client.exists(self.index.keys.rebuild_lock))

    async def check_epoch(self) -> None:
        """Rebuild a lost index, or one restored from an older snapshot; else move the index
        generation forward (in Redis first, then PostgreSQL), so that a snapshot taken now is
        recognised as old once it is restored later."""
        # PostgreSQL first: Redis is moved forward before PostgreSQL, so a Redis generation
        # read after this one is behind it only if Redis lost data since. Read the other way
        # round, another sweeper advancing both in between would look like a restore.
        if await self.foreign_index():
            return
        expected = await self.store.index_generation()
        epoch = await self.index.client.get(self.index.keys.epoch)
        metrics.INDEX_EPOCH_PRESENT.set(1 if epoch else 0)
        if self.rebuilding is not None and not self.rebuilding.done():
            return
        if not epoch:
            self.rebuilding = asyncio.create_task(self.rebuild_with_lock(), name="rebuild")
            return
        generation = int(epoch)
        if generation < expected:
            log.error(
                "index is older than PostgreSQL says (restored from an old snapshot?): "
                "dropping it and rebuilding",
                extra={"action": "stale_index", "generation": generation, "expected": expected},
            )
            metrics.STALE_INDEX.inc()
            await self.index.client.delete(self.index.keys.epoch)
            await self.index.wipe()
            metrics.INDEX_EPOCH_PRESENT.set(0)
            self.rebuilding = asyncio.create_task(self.rebuild_with_lock(), name="rebuild")
            return
        following = generation + 1
        if await self.index.client.set(self.index.keys.epoch, following, xx=True):
            await self.store.advance_index_generation(following)

    async def rebuild_with_lock(self) -> None:
        lock = Lock(
            self.index.client, self.index.keys.rebuild_lock, timeout=REBUILD_LOCK_S, blocking=False
        )
        if not await lock.acquire(token=self.identity):
            return
        # The rebuild stops when its lock is lost (it expired while Redis was away, or Redis
        # lost it): another sweeper may be rebuilding by then, and two rebuilds overwrite each
        # other's witness, so the first to end drops the epoch the other may have set.
        renew = asyncio.create_task(self._renew(lock), name="rebuild-lock")
        work = asyncio.create_task(self._rebuild_if_missing(), name="rebuild-work")
        try:
            await asyncio.wait([work, renew], return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()
            else:
                # Lost, or it could not be renewed (an error): either way it will not be held.
                failed = renew.exception()
                log.warning(
                    "rebuild lock lost; the rebuild stops and will start over",
                    extra={"action": "rebuild_lock_lost", "error": repr(failed) if failed else ""},
                )
        except _REBUILD_INTERRUPTIONS as exc:
            log.warning(
                "rebuild interrupted; it will start over",
                extra={"action": "rebuild_interrupted", "error": repr(exc)},
            )
        finally:
            await _cancel_all([work, renew])
            with contextlib.suppress(Exception):
                await lock.release()

    async def _rebuild_if_missing(self) -> None:
        if not await self.index.client.get(self.index.keys.epoch):
            await self.rebuild()

    async def _renew(self, lock: Lock) -> None:
        """Keeps the rebuild lock; returns once it is no longer this sweeper's."""
        while True:
            await asyncio.sleep(REBUILD_LOCK_RENEW_S)
            try:
                await lock.reacquire()
            except redis_errors.LockNotOwnedError:
                return
            except transient.ERRORS:
                continue

    async def rebuild(self) -> int:
        """Stream every live schedule from PostgreSQL, highest priority first, into the shards;
        then set the epoch. Dispatchers fire what is rebuilt while the rest streams in."""
        started = time.monotonic()
        log.warning(
            "index epoch missing: rebuilding from PostgreSQL", extra={"action": "rebuild_started"}
        )
        metrics.REBUILD_RUNNING.set(1)
        written = 0
        token = uuid.uuid4().hex
        try:
            await self._await_audit_barrier()
            servers = await self._redis_servers()
            await self._witness_rebuild(token)
            await self.start_positions()
            written = await self._stream_into_index()
            await pending.restore_all(self.index, self.store, self.settings.rebuild_batch)
            await backfills.restore_all(self.index, self.store, self.settings.rebuild_batch)
            generation = await self.store.index_generation() + 1
            await self.index.client.set(self.index.keys.epoch, generation)
            # Checked after the epoch is set: Redis losing data after the check takes the
            # epoch with it, so a rebuild follows either way. The witness alone is not enough:
            # a Redis that restarted from a snapshot (RDB or AOF) taken during the rebuild
            # has it back, without the pages written after the snapshot, and the client's
            # retries (and NOSCRIPT reloads) hide such a restart from the writes.
            if not await self._rebuild_witnessed(token) or not same_servers(
                servers, await self._redis_servers()
            ):
                await self.index.client.delete(self.index.keys.epoch)
                raise IndexLostDuringRebuild("Redis lost data while the rebuild ran")
            await self.store.advance_index_generation(generation)
        finally:
            metrics.REBUILD_RUNNING.set(0)
            metrics.REBUILD_PROGRESS.set(0)
        duration = time.monotonic() - started
        metrics.REBUILDS.inc()
        metrics.REBUILD_DURATION.set(duration)
        metrics.INDEX_EPOCH_PRESENT.set(1)
        log.warning(
            "index rebuilt",
            extra={
                "action": "rebuild_done",
                "schedules": written,
                "duration_s": round(duration, 3),
            },
        )
        return written

    async def _await_audit_barrier(self) -> None:
        """Before PostgreSQL is read: every live executor writes the completions Redis
        acknowledged before it lost its data (``services.executor.barrier``), or the rebuild
        would place their occurrences again and, where the misfire policy moves on, count one
        fire too few. Waits at most ``CRONBUS_REBUILD_AUDIT_WAIT_S``."""
        started = time.monotonic()
        asked = await barrier.request(self.store.pool)
        deadline = started + self.settings.rebuild_audit_wait_s
        while True:
            behind = await barrier.writers_behind(self.store.pool, asked)
            if not behind:
                metrics.REBUILD_AUDIT_WAIT.set(time.monotonic() - started)
                return
            if time.monotonic() >= deadline:
                metrics.REBUILD_AUDIT_WAIT.set(time.monotonic() - started)
                log.warning(
                    "rebuild goes on without the audit writes of executors that did not answer",
                    extra={
                        "action": "audit_barrier_timeout",
                        "executors": behind[:20],
                        "waited_s": round(time.monotonic() - started, 3),
                    },
                )
                return
            await asyncio.sleep(BARRIER_POLL_S)

    async def _witness_rebuild(self, token: str) -> None:
        pipe = self.index.client.pipeline(transaction=False)
        for shard in range(self.settings.shards):
            pipe.set(self.index.keys.rebuild_witness(shard), token, ex=REBUILD_WITNESS_TTL_S)
        await pipe.execute()

    async def _redis_servers(self) -> frozenset[str] | None:
        """The run ids of the Redis servers behind the index (a restart gives a server a new
        one); None when this user may not ask (INFO refused by an ACL): the witness alone
        then tells."""
        client = self.index.client
        try:
            if isinstance(client, RedisCluster):
                # Every primary: the default node alone would miss the others' restarts.
                info = await client.info("server", target_nodes=RedisCluster.PRIMARIES)
            else:
                info = await client.info("server")
        except redis_errors.NoPermissionError:
            return None
        return _run_ids(info)

    async def _rebuild_witnessed(self, token: str) -> bool:
        """Whether every shard still holds this rebuild's token (none lost data since)."""
        pipe = self.index.client.pipeline(transaction=False)
        for shard in range(self.settings.shards):
            pipe.get(self.index.keys.rebuild_witness(shard))
        found = await pipe.execute()
        return all(
            value is not None and (value.decode() if isinstance(value, bytes) else value) == token
            for value in found
        )

    async def _stream_into_index(self) -> int:
        """Every live row written to the index, a page at a time: the next page is read from
        PostgreSQL and its entries worked out while Redis runs the previous page's write."""
        clock = await RedisClock.read(self)
        written = 0
        # Each page's write starts before the previous one is awaited: two pages in flight.
        in_flight: deque[asyncio.Task[int]] = deque()
        pages = read_ahead(self.store.live_schedules(self.settings.rebuild_batch))
        try:
            async with contextlib.aclosing(pages):
                async for chunk in pages:
                    now = await clock.now_ms(self)
                    in_flight.append(asyncio.create_task(self._write_entries(chunk, now)))
                    if len(in_flight) > 1:
                        written += await in_flight.popleft()
                        self._rebuild_progress(written, len(chunk))
            while in_flight:
                written += await in_flight.popleft()
        finally:
            await _cancel_all(in_flight)
        return written

    def _rebuild_progress(self, written: int, page: int) -> None:
        metrics.REBUILD_PROGRESS.set(written)
        if written and written % 100_000 < page:
            log.info("rebuild progress", extra={"action": "rebuild_progress", "schedules": written})

    async def _write_entries(self, rows: Sequence[LiveSchedule], now: int) -> int:
        """One page of rows written to the index, as of ``now`` (the Redis clock)."""
        entries = []
        for row in rows:
            entry = entry_of(row, now)
            if entry is not None:
                entries.append((self.index.shard_of(row.namespace, row.id), entry))
        if entries:
            await self.index.upsert(group_by_shard(entries))
        return len(entries)
