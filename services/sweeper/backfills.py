"""Backfills back into a Redis index that lost them.

PostgreSQL keeps every running backfill until it ends (``backfills``): where it stands (the
nominal time of its current occurrence) and how many occurrences it has left. Two paths put one
back: the rebuild of a lost index restores them all, and drift repair re-adds one the index
does not hold (an intake that died between its PostgreSQL and Redis writes). A backfill resumes
at the occurrence PostgreSQL last recorded: one the executors had completed just before the
loss may be delivered again, with the same idempotency key.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.sweeper import suspects
from shared.contract import keys
from shared.contract.entries import BackfillStart
from shared.contract.rows import LiveBackfill
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.runtime import metrics

log = logging.getLogger(__name__)

#: A backfill younger than this may still be on its way from the intake to Redis.
MIN_AGE_MS = 60_000
#: Most backfills one drift check looks at.
CHECK_LIMIT = 10_000

Identity = tuple[str, str, int]


def identity(row: LiveBackfill) -> Identity:
    return (row.namespace, row.id, row.generation)


def start_of(row: LiveBackfill) -> BackfillStart:
    return BackfillStart(
        keys.member(row.namespace, row.id),
        row.generation,
        row.to_ms,
        row.remaining,
        row.next_ms,
    )


async def restore(index: Index, rows: Sequence[LiveBackfill]) -> int:
    """Write each backfill the index does not hold at its generation; returns how many."""
    restored = 0
    for row in rows:
        shard = index.shard_of(row.namespace, row.id)
        if await index.start_backfill(shard, start_of(row)):
            restored += 1
    return restored


async def restore_all(index: Index, store: Store, batch: int) -> int:
    """The rebuild's last part: every backfill of a schedule in rotation or paused."""
    restored = 0
    async for chunk in store.live_backfills(batch):
        restored += await restore(index, chunk)
    if restored:
        log.warning(
            "backfills restored", extra={"action": "backfills_restored", "backfills": restored}
        )
    return restored


class BackfillRepair:
    """Drift repair of backfills. One must be seen missing from the index in two checks in a
    row before it is put back: an executor ends a backfill in Redis a moment before its audit
    batch removes the row, and one check could fall in between."""

    def __init__(
        self, index: Index, store: Store, min_age_ms: int = MIN_AGE_MS, limit: int = CHECK_LIMIT
    ) -> None:
        self.index = index
        self.store = store
        self.min_age_ms = min_age_ms
        self.limit = limit
        self._suspects: set[Identity] = set()

    async def _missing(self, rows: Sequence[LiveBackfill]) -> list[LiveBackfill]:
        missing = []
        for row in rows:
            shard = self.index.shard_of(row.namespace, row.id)
            [held] = await self.index.backfill_generations(
                shard, [keys.member(row.namespace, row.id)]
            )
            if held is None or held < row.generation:
                missing.append(row)
        return missing

    async def check(self, now_ms: int) -> int:
        """One check; returns the backfills put back."""
        rows = await self.store.old_backfills(now_ms - self.min_age_ms, self.limit)
        missing = await self._missing(rows)
        confirmed, self._suspects = suspects.confirm(self._suspects, missing, identity)
        if not confirmed:
            return 0
        added = await restore(self.index, confirmed)
        if added:
            metrics.DRIFT_REPAIRED.labels("backfill").inc(added)
            log.warning(
                "backfills re-added to the index",
                extra={"action": "backfills_repaired", "backfills": added},
            )
        return added
