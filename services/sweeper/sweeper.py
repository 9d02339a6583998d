"""Recovery: reclaim expired leases, rebuild a lost index, repair drift, keep retention.

Several sweepers may run; a short lock makes one of them act per step, and it expires by
itself if that sweeper dies. A rebuild has its own lock, renewed while it runs
(``rebuild.py``); drift repair and tombstones are in ``repair.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable

from redis.asyncio.lock import Lock

from services.sweeper import backfills, drift, pending, targets
from services.sweeper.positions import PositionReplay
from shared.postgres import barrier, db
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.runtime import metrics, transient
from shared.runtime.config import SweeperSettings

log = logging.getLogger(__name__)


class Sweeper(PositionReplay):
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

    # --- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        # Beside the loop, not before it: the check reads every AMQP target, and recovery must
        # not wait for it.
        checking = asyncio.create_task(
            targets.report_refused(self.store, self.settings.exchange_policy(), self.stopping)
        )
        replaying = asyncio.create_task(
            transient.every(
                self.settings.position_check_s,
                self.keep_positions,
                what="position check",
                stopping=self.stopping,
            ),
            name="position-check",
        )
        await transient.every(
            self.settings.sweep_interval_s, self.step, what="sweep step", stopping=self.stopping
        )
        with contextlib.suppress(asyncio.CancelledError, *transient.ERRORS):
            await replaying
        if not checking.done():
            checking.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await checking
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
        # The console shows the last hour of per-namespace minutes; a day is plenty. A flush id
        # only guards against a retry seconds after its commit: a day is plenty too.
        day_ago = dt.datetime.fromtimestamp(self.clock(), dt.UTC) - dt.timedelta(days=1)
        await self.store.trim_minutes(day_ago)
        await self.store.trim_audit_flushes(day_ago)
        await barrier.trim(self.store.pool, day_ago)
        if dropped:
            metrics.PARTITIONS_DROPPED.inc(len(dropped))
            log.info(
                "execution partitions dropped", extra={"action": "retention", "partitions": dropped}
            )
