"""Runs outside the rotation (triggers) back into a Redis index that lost them.

PostgreSQL keeps every pending run until it completes (``pending_runs``). Two paths put one
back: the rebuild of a lost index restores them all, and drift repair re-adds a run that is
old yet in neither ``due`` nor ``lease`` (an intake that died between its PostgreSQL and
Redis writes). Both add with ZADD NX semantics and never touch a run in flight.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence

from services.sweeper import suspects
from shared.contract import keys
from shared.contract.entries import Upsert
from shared.contract.rows import PendingRun, PendingRunRow
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.runtime import metrics

log = logging.getLogger(__name__)

#: A pending run younger than this may still be on its way from the intake to Redis.
MIN_AGE_MS = 60_000
#: Most pending runs one drift check looks at.
CHECK_LIMIT = 10_000

Identity = tuple[str, str, str, int]


def member_of(run: PendingRun) -> str | None:
    """The index member of a pending run (None: a kind this version does not index)."""
    if run.kind == "trigger":
        return keys.trigger_member(run.namespace, run.id, run.nominal_ms)
    return None


def identity(run: PendingRun) -> Identity:
    return (run.namespace, run.id, run.kind, run.nominal_ms)


def schedule_park(row: PendingRunRow) -> Upsert | None:
    """A run of a completed schedule needs the schedule stored (out of rotation) to be
    claimed, as the intake's trigger does; an active or paused one is restored with its
    schedule already."""
    if row.state != "completed":
        return None
    member = keys.member(row.run.namespace, row.run.id)
    return Upsert(member, row.version, row.compact, "park", None)


async def _in_flight_or_due(index: Index, runs: Sequence[tuple[int, str]]) -> list[bool]:
    """Whether each (shard, member) is in ``due`` or in ``lease``: one round trip."""
    pipe = index.client.pipeline(transaction=False)
    for shard, member in runs:
        pipe.zscore(index.keys.due(shard), member)
        pipe.zscore(index.keys.lease(shard), member)
    scores = await pipe.execute()
    return [scores[2 * i] is not None or scores[2 * i + 1] is not None for i in range(len(runs))]


async def add_missing(index: Index, rows: Sequence[PendingRunRow]) -> int:
    """Put back every run that is neither due nor in flight; returns how many were added.

    The check and the add are two steps, and that is safe: a run can only enter ``lease``
    from ``due``, and the add is NX, so a run that came due meanwhile is left as it is.
    """
    located = [
        (row, index.shard_of(row.run.namespace, row.run.id), member)
        for row in rows
        if (member := member_of(row.run)) is not None
    ]
    if not located:
        return 0
    present = await _in_flight_or_due(index, [(shard, member) for _, shard, member in located])
    missing = [item for item, known in zip(located, present, strict=True) if not known]
    if not missing:
        return 0
    parks: dict[int, list[Upsert]] = defaultdict(list)
    for row, shard, _ in missing:
        park = schedule_park(row)
        if park is not None:
            parks[shard].append(park)
    if parks:
        await index.upsert(dict(parks))
    pipe = index.client.pipeline(transaction=False)
    for row, shard, member in missing:
        pipe.zadd(index.keys.due(shard), {member: row.run.nominal_ms}, nx=True)
    added = sum(int(n) for n in await pipe.execute())
    return added


async def restore_all(index: Index, store: Store, batch: int) -> int:
    """The rebuild's last part: every pending run of a schedule that is not deleted."""
    restored = 0
    async for chunk in store.live_pending_runs(batch):
        restored += await add_missing(index, chunk)
    if restored:
        log.warning("pending runs restored", extra={"action": "pending_restored", "runs": restored})
    return restored


class PendingRepair:
    """Drift repair of pending runs. A run must be seen missing from the index in two checks
    in a row before it is re-added: an executor's completion reaches Redis a moment before
    its audit batch removes the pending row, and one check could fall in between."""

    def __init__(
        self, index: Index, store: Store, min_age_ms: int = MIN_AGE_MS, limit: int = CHECK_LIMIT
    ) -> None:
        self.index = index
        self.store = store
        self.min_age_ms = min_age_ms
        self.limit = limit
        self._suspects: set[Identity] = set()

    async def check(self, now_ms: int) -> int:
        """One check; returns the runs re-added."""
        rows = await self.store.old_pending_runs(now_ms - self.min_age_ms, self.limit)
        located = [
            (row, self.index.shard_of(row.run.namespace, row.run.id), member)
            for row in rows
            if (member := member_of(row.run)) is not None
        ]
        if not located:
            self._suspects = set()
            return 0
        present = await _in_flight_or_due(self.index, [(s, m) for _, s, m in located])
        missing = [row for (row, _, _), known in zip(located, present, strict=True) if not known]
        confirmed, self._suspects = suspects.confirm(
            self._suspects, missing, lambda row: identity(row.run)
        )
        if not confirmed:
            return 0
        added = await add_missing(self.index, confirmed)
        if added:
            metrics.DRIFT_REPAIRED.labels("pending").inc(added)
            log.warning(
                "pending runs re-added to the index",
                extra={"action": "pending_repaired", "runs": added},
            )
        return added
