"""Recovery: reclaim expired leases, rebuild a lost index, repair drift, keep retention.

Several sweepers may run; a short lock makes one of them act per step, and it expires by
itself if that sweeper dies. A rebuild has its own lock, renewed while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.lock import Lock

from services.sweeper import backfills, drift, pending
from shared.contract import keys
from shared.contract.entries import Upsert
from shared.contract.rows import Checkpoint, LiveSchedule
from shared.postgres import db
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.rules import compact, rotation
from shared.rules.plan import same_rotation
from shared.runtime import metrics, transient
from shared.runtime.config import SweeperSettings
from shared.runtime.readahead import read_ahead

log = logging.getLogger(__name__)

#: Drift repair looks this far behind the previous check, on PostgreSQL's clock: a row is
#: stamped when its transaction starts, and may commit a little later.
DRIFT_OVERLAP_MS = 10_000
#: Members read from Redis per round trip during a full drift scan.
SCAN_BATCH = 1000
#: Tombstones are kept at least this long: past any rebuild or repair that read PostgreSQL
#: before the delete or the finish they record.
TOMBSTONE_KEEP_MS = 600_000
#: How often tombstones are looked at (ms).
TOMBSTONE_CHECK_MS = 60_000
#: The rebuild lock's time to live (s), and how often a running rebuild renews it.
REBUILD_LOCK_S = 60
REBUILD_LOCK_RENEW_S = 15.0
#: A rebuild's witness keys outlive any rebuild; an interrupted one's go by themselves.
REBUILD_WITNESS_TTL_S = 7 * 86_400


class IndexLostDuringRebuild(Exception):
    """Redis lost data while a rebuild ran: what the rebuild wrote before may be gone, so the
    index is not complete and the epoch must stay unset (the next check rebuilds again)."""


#: What ends a rebuild early, to start over at the next check.
_REBUILD_INTERRUPTIONS: tuple[type[BaseException], ...] = (
    *transient.ERRORS,
    IndexLostDuringRebuild,
)


def _group(entries: Iterable[tuple[int, Upsert]]) -> dict[int, list[Upsert]]:
    grouped: dict[int, list[Upsert]] = defaultdict(list)
    for shard, entry in entries:
        grouped[shard].append(entry)
    return grouped


def _finished_checkpoint(row: LiveSchedule) -> Checkpoint:
    """The checkpoint a schedule finished in Redis should have written to PostgreSQL."""
    last = row.next_fire_ms if row.next_fire_ms is not None else row.last_fire_ms
    return Checkpoint(
        row.namespace, row.id, last or 0, None, row.fires + 1, finished=True, version=row.version
    )


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


def _same_servers(before: frozenset[str] | None, after: frozenset[str] | None) -> bool:
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


def _entry_of(row: LiveSchedule, now_ms: int) -> Upsert | None:
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
    async def read(cls, sweeper: Sweeper) -> RedisClock:
        return cls(await sweeper.redis_now_ms(), time.monotonic())

    async def now_ms(self, sweeper: Sweeper) -> int:
        elapsed = time.monotonic() - self.read_at
        if elapsed >= self.REREAD_S:
            self.redis_ms, self.read_at = await sweeper.redis_now_ms(), time.monotonic()
            return self.redis_ms
        return self.redis_ms + int(elapsed * 1000)


class Sweeper:
    def __init__(
        self,
        settings: SweeperSettings,
        index: Index,
        store: Store,
        stopping: asyncio.Event,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.index = index
        self.store = store
        self.stopping = stopping
        self.clock = clock
        self.identity = uuid.uuid4().hex
        self.rebuilding: asyncio.Task[None] | None = None
        self._last_drift_ms = 0
        self._drift_since_ms: int | None = None
        #: Where the rolling full comparison stands: the last row key compared, and the
        #: shard and HSCAN cursor of the index entries.
        self._rows_after: tuple[str, str] = ("", "")
        self._entries_at: tuple[int, int] = (0, 0)
        #: Least rows and entries one drift check compares (``drift.SLICE_MIN``).
        self.slice_min = drift.SLICE_MIN
        self._last_retention = 0.0
        self._last_tombstones_ms = 0
        self.pending_repair = pending.PendingRepair(index, store)
        self.backfill_repair = backfills.BackfillRepair(index, store)

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    # --- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        await transient.every(
            self.settings.sweep_interval_s, self.step, what="sweep step", stopping=self.stopping
        )
        if self.rebuilding is not None and not self.rebuilding.done():
            # The rebuild lock expires by itself; another sweeper starts over ('keep' writes
            # make a second pass harmless).
            self.rebuilding.cancel()
            with contextlib.suppress(asyncio.CancelledError, *transient.ERRORS):
                await self.rebuilding

    async def step(self) -> None:
        lock = Lock(
            self.index.client,
            self.index.keys.sweep_lock,
            timeout=max(self.settings.sweep_interval_s * 3, 10),
            blocking=False,
        )
        if not await lock.acquire(token=self.identity):
            return
        try:
            await self.reclaim()
            await self.check_epoch()
            await self.repair_drift()
            await self.trim_tombstones()
            await self.keep_retention()
        finally:
            with contextlib.suppress(Exception):
                await lock.release()

    # --- expired leases -----------------------------------------------------------------------

    async def reclaim(self) -> int:
        """Leases past their deadline go back to due (a few rounds at most per step)."""
        total = 0
        shards = list(range(self.settings.shards))
        for _ in range(10):
            counts = await self.index.reclaim(shards, self.settings.reclaim_batch)
            reclaimed = sum(r for r, _ in counts.values())
            total += reclaimed
            shards = [s for s, (r, d) in counts.items() if r + d >= self.settings.reclaim_batch]
            if not shards:
                break
        if total:
            metrics.RECLAIMED.inc(total)
            log.info("expired leases reclaimed", extra={"action": "reclaimed", "count": total})
        return total

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
            servers = await self._redis_servers()
            await self._witness_rebuild(token)
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
            if not await self._rebuild_witnessed(token) or not _same_servers(
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
            entry = _entry_of(row, now)
            if entry is not None:
                entries.append((self.index.shard_of(row.namespace, row.id), entry))
        if entries:
            await self.index.upsert(_group(entries))
        return len(entries)

    # --- drift --------------------------------------------------------------------------------

    async def repair_drift(self) -> None:
        """Re-index what PostgreSQL changed recently if Redis lags it (an intake that died
        between its two writes); now and then, compare everything both ways."""
        now = self.now_ms()
        if now - self._last_drift_ms < self.settings.drift_check_interval_s * 1000:
            return
        self._last_drift_ms = now
        if self.rebuilding is not None and not self.rebuilding.done():
            return
        # Incremental: only rows stamped since the previous check began (each row is looked
        # at about once, so a herd's own rows are never re-read check after check).
        database_now = await self.store.clock_ms()
        since = (self._drift_since_ms or database_now) - DRIFT_OVERLAP_MS
        self._drift_since_ms = database_now
        async for chunk in self.store.changed_schedules(since, self.settings.rebuild_batch):
            await self.reconcile(chunk)
        await self.pending_repair.check(now)
        await self.backfill_repair.check(now)
        await self.drift_slice()

    async def drift_slice(self) -> int:
        """The next slice of the full comparison, both ways: rows against the index, index
        entries against PostgreSQL. The slices add up to a full pass every
        ``drift_full_interval_s`` (see ``services.sweeper.drift``)."""
        entries = await self._index_entries()
        size = drift.slice_size(
            entries,
            self.settings.drift_check_interval_s,
            self.settings.drift_full_interval_s,
            least=self.slice_min,
        )
        versions = await self.store.live_versions_after(self._rows_after, size)
        repaired = 0
        batch = self.settings.rebuild_batch
        for start in range(0, len(versions), batch):
            # Versions first: whole rows are read (and decoded) only for the entries the index
            # lacks or holds at an older version, which is nearly none of them.
            behind = await self._behind(versions[start : start + batch])
            if behind:
                repaired += await self.reconcile(await self.store.schedule_versions(behind))
        # A short slice reached the end of the table: the next check starts over.
        self._rows_after = versions[-1][:2] if len(versions) == size else ("", "")
        return repaired + await self._orphans_slice(size)

    async def _behind(self, versions: Sequence[tuple[str, str, int]]) -> list[tuple[str, str]]:
        """Of these live rows, those whose index entry is missing or at an older version."""
        stored = await self._stored_plans([(ns, i) for ns, i, _ in versions])
        behind = []
        for ns, i, version in versions:
            plan = stored.get(keys.member(ns, i))
            if plan is None or compact.version_of(plan) < version:
                behind.append((ns, i))
        return behind

    def drift_sides_at_start(self) -> tuple[bool, bool]:
        """Whether the full comparison's rows side, and its index side, start over next."""
        return self._rows_after == ("", ""), self._entries_at == (0, 0)

    async def _index_entries(self) -> int:
        pipe = self.index.client.pipeline(transaction=False)
        for shard in range(self.settings.shards):
            pipe.hlen(self.index.keys.sched(shard))
        return sum(int(count) for count in await pipe.execute())

    async def _orphans_slice(self, budget: int) -> int:
        """Index entries without a live row removed, ``budget`` entries (about) from where the
        previous slice stopped; at most one pass over the shards per call."""
        removed = seen = 0
        shard, cursor = self._entries_at
        while seen < budget:
            cursor, batch = await self.index.client.hscan(
                self.index.keys.sched(shard), cursor, count=SCAN_BATCH
            )
            removed += await self._remove_orphans_in(shard, batch)
            seen += len(batch)
            if cursor == 0:
                shard = (shard + 1) % self.settings.shards
                if shard == 0:
                    break  # the pass over every shard ends here
        self._entries_at = (shard, cursor)
        return removed

    async def reconcile(self, rows: Sequence[LiveSchedule]) -> int:
        """Bring the index in line with these PostgreSQL rows; returns the entries repaired."""
        if not rows:
            return 0
        stored = await self._stored_plans([(r.namespace, r.id) for r in rows])
        repairs: list[tuple[int, Upsert]] = []
        removals: dict[int, list[tuple[str, int | None]]] = defaultdict(list)
        now = await self.redis_now_ms()
        for row in rows:
            member = keys.member(row.namespace, row.id)
            shard = self.index.shard_of(row.namespace, row.id)
            old = stored.get(member)
            if row.state == "deleted":
                if old is not None:
                    removals[shard].append((member, row.version))
                    metrics.DRIFT_REPAIRED.labels("orphan").inc()
                continue
            if row.state == "completed" and old is not None:
                if compact.version_of(old) < row.version:
                    # A change ended it (the intake removes it) and that removal never landed:
                    # the older rotation would go on firing. Removed at the version seen, so a
                    # completed schedule parked later for a pending trigger is not refused.
                    removals[shard].append((member, compact.version_of(old)))
                    metrics.DRIFT_REPAIRED.labels("stale").inc()
                continue
            if row.state not in ("active", "paused") or (
                old is not None and compact.version_of(old) >= row.version
            ):
                continue
            entry = _entry_of(row, now)
            if entry is None:
                continue
            if (
                old is not None
                and entry.mode == "keep"
                and not same_rotation(compact.decode(old), compact.decode(row.compact))
            ):
                # The stored copy fires at other times: its rotation is replaced.
                entry = dataclasses.replace(entry, mode="reset")
            repairs.append((shard, entry))
        repaired = await self._write_repairs(repairs, stored)
        if removals:
            await self.index.remove(dict(removals))
            repaired += sum(len(v) for v in removals.values())
        if repaired:
            log.warning(
                "index drift repaired", extra={"action": "drift_repaired", "entries": repaired}
            )
        return repaired

    async def _write_repairs(
        self, repairs: Sequence[tuple[int, Upsert]], stored: dict[str, bytes]
    ) -> int:
        """Write the repairs; the script re-checks each against what the index holds at that
        moment (a newer version, or a tombstone of a finished or deleted schedule wins), so a
        repair decided from an earlier read never touches an occurrence in flight or done."""
        if not repairs:
            return 0
        codes = await self.index.upsert(_group(repairs))
        written = 0
        cursors = dict.fromkeys(codes, 0)
        for shard, entry in repairs:
            code = codes[shard][cursors[shard]]
            cursors[shard] += 1
            if code == 1:
                written += 1
                kind = "missing" if entry.member not in stored else "stale"
                metrics.DRIFT_REPAIRED.labels(kind).inc()
        return written

    async def _stored_plans(self, members: Sequence[tuple[str, str]]) -> dict[str, bytes]:
        """The compact schedules the index holds for these members (absent ones left out).

        One HMGET per shard: a reply per member costs the client far more than the read."""
        by_shard: dict[int, list[str]] = defaultdict(list)
        for ns, i in members:
            by_shard[self.index.shard_of(ns, i)].append(keys.member(ns, i))
        pipe = self.index.client.pipeline(transaction=False)
        for shard, names in by_shard.items():
            pipe.hmget(self.index.keys.sched(shard), names)
        replies = await pipe.execute()
        return {
            name: value
            for names, values in zip(by_shard.values(), replies, strict=True)
            for name, value in zip(names, values, strict=True)
            if value is not None
        }

    async def full_drift_scan(self) -> int:
        """Every index entry checked against PostgreSQL, and every live row against the index."""
        repaired = 0
        pages = read_ahead(self.store.live_schedules(self.settings.rebuild_batch))
        async with contextlib.aclosing(pages):
            async for chunk in pages:
                repaired += await self.reconcile(chunk)
        for shard in range(self.settings.shards):
            repaired += await self._remove_orphans(shard)
        return repaired

    async def _remove_orphans(self, shard: int) -> int:
        """Index entries with no live PostgreSQL row behind them are removed."""
        removed = 0
        cursor = 0
        while True:
            cursor, batch = await self.index.client.hscan(
                self.index.keys.sched(shard), cursor, count=SCAN_BATCH
            )
            removed += await self._remove_orphans_in(shard, batch)
            if cursor == 0:
                return removed

    async def _remove_orphans_in(self, shard: int, batch: object) -> int:
        """Of one HSCAN batch of a shard, the entries without a live row, removed."""
        # The version seen goes with each removal: a schedule recreated (a newer version
        # written) after PostgreSQL was read is left alone by remove.lua.
        stored: dict[bytes, bytes] = dict(batch)  # type: ignore[call-overload]
        seen = {m.decode(): compact.version_of(plan) for m, plan in stored.items()}
        members = list(seen)
        if not members:
            return 0
        pairs = [keys.split_member(m)[:2] for m in members]
        states = await self.store.schedule_states(pairs)
        # A completed row keeps its entry (parked for a pending trigger) unless the entry is
        # of an older version: the change that ended it never reached the index.
        live = {
            member
            for member, (state, version) in states.items()
            if state != "deleted" and not (state == "completed" and seen[member] < version)
        }
        orphans: list[tuple[str, int | None]] = [(m, seen[m]) for m in members if m not in live]
        if orphans:
            await self.index.remove({shard: orphans})
            metrics.DRIFT_REPAIRED.labels("orphan").inc(len(orphans))
        return len(orphans)

    # --- tombstones ---------------------------------------------------------------------------

    async def trim_tombstones(self) -> int:
        """Drop old tombstones once PostgreSQL agrees the schedule is deleted or finished.

        A finished schedule whose checkpoint never reached PostgreSQL (its executor died
        between finishing it in Redis and writing the audit) is marked finished there now.
        """
        now = await self.redis_now_ms()
        if now - self._last_tombstones_ms < TOMBSTONE_CHECK_MS:
            return 0
        if await self._rebuild_running():
            # A rebuild streams an old read of PostgreSQL: the tombstones must outlive it.
            return 0
        self._last_tombstones_ms = now
        trimmed = 0
        for shard in range(self.settings.shards):
            cursor = 0
            while True:
                cursor, batch = await self.index.client.hscan(
                    self.index.keys.gone(shard), cursor, count=SCAN_BATCH
                )
                trimmed += await self._trim(shard, batch, now)
                if cursor == 0:
                    break
        if trimmed:
            metrics.TOMBSTONES_TRIMMED.inc(trimmed)
        return trimmed

    async def _trim(self, shard: int, batch: Any, now: int) -> int:
        old: dict[str, tuple[int, bytes, bool]] = {}
        for raw_member, value in batch.items():
            buried, at, kind = [*value.decode().split("|"), "", ""][:3]
            if now - int(at or 0) >= TOMBSTONE_KEEP_MS:
                old[raw_member.decode()] = (int(buried), value, kind == "f")
        if not old:
            return 0
        rows = {
            keys.member(r.namespace, r.id): r
            for r in await self.store.schedule_versions([keys.split_member(m)[:2] for m in old])
        }
        settled: list[tuple[str, bytes]] = []
        finished: list[Checkpoint] = []
        for member, (version, value, was_finished) in old.items():
            row = rows.get(member)
            if row is not None and row.state == "active" and row.version == version:
                if was_finished:
                    finished.append(_finished_checkpoint(row))
            elif row is None or row.state != "active" or row.version > version:
                settled.append((member, value))
        if finished:
            await self.store.write_checkpoints(finished)
        return await self.index.forget(shard, settled) if settled else 0

    # --- retention ----------------------------------------------------------------------------

    async def keep_retention(self) -> None:
        """Daily partitions ahead of time; whole partitions past retention dropped (hourly)."""
        if time.monotonic() - self._last_retention < 3600 and self._last_retention:
            return
        self._last_retention = time.monotonic()
        today = dt.datetime.fromtimestamp(self.clock(), dt.UTC).date()
        async with self.store.pool.acquire() as conn:
            await db.ensure_partitions(conn, today, self.settings.partitions_ahead_days)
            dropped = await db.drop_partitions_before(
                conn, today - dt.timedelta(days=self.settings.retention_days)
            )
        if dropped:
            metrics.PARTITIONS_DROPPED.inc(len(dropped))
            log.info(
                "execution partitions dropped", extra={"action": "retention", "partitions": dropped}
            )
