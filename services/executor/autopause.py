"""pause_after_failures: N consecutive occurrences ending dead pause the schedule.

The count lives in Redis (``failures.lua``, batched per shard like completions), so every
executor adds to the same count. When it reaches N the executor pauses the schedule as a
``pause`` command would: PostgreSQL first (state paused at a new version, the reason, an audit
row, the shard's next position), then the index is parked at that version, and the position is
recorded in Redis and marked answered (invariant 9): a failover to a replica that lacks the
park leaves the shard behind its answered position, fenced until the sweeper's position check
has parked it again, so the schedule does not fire again. Should the executor die between the
two writes, that position check (the shard is behind PostgreSQL) parks it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence

from services.executor.events import Events
from shared.contract import keys, timefmt
from shared.contract.delivery import Occurrence
from shared.contract.entries import Upsert
from shared.contract.rows import CommandAudit, NewScheduleRow
from shared.postgres import positions
from shared.postgres.store import Store
from shared.redis.batcher import Batcher
from shared.redis.index import Index
from shared.rules import compact
from shared.runtime import metrics, transient

log = logging.getLogger(__name__)

BATCH_ITEMS = 2000
Item = tuple[int, tuple[str, str]]


class AutoPause:
    def __init__(
        self,
        index: Index,
        store: Store,
        events: Events,
        stopping: asyncio.Event,
        flush_ms: int,
    ) -> None:
        self.index = index
        self.store = store
        self.events = events
        self.stopping = stopping
        self._counts = Batcher(
            self._flush, max_delay_ms=flush_ms, max_items=BATCH_ITEMS, name="failures"
        )

    async def _flush(self, items: Sequence[Item]) -> list[int]:
        by_shard: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for shard, item in items:
            by_shard[shard].append(item)
        counts = await self.index.count_failures(dict(by_shard))
        cursors = dict.fromkeys(counts, 0)
        ordered = []
        for shard, _ in items:
            ordered.append(counts[shard][cursors[shard]])
            cursors[shard] += 1
        return ordered

    async def record(self, occ: Occurrence, event: str) -> None:
        """Count a settled occurrence of a schedule that set pause_after_failures."""
        threshold = occ.plan.pause_after_failures
        if threshold is None or event not in ("succeeded", "dead"):
            return
        member = keys.member(occ.namespace, occ.id)
        outcome = "dead" if event == "dead" else "clear"
        count = await transient.retry(
            lambda: self._counts.submit((occ.shard, (member, outcome))),
            what="failure count",
            stopping=self.stopping,
        )
        if outcome == "dead" and count >= threshold:
            await self.pause(occ, count)

    async def pause(self, occ: Occurrence, count: int) -> int | None:
        """Pause the schedule at the version that failed; the new version, or None when a
        command changed it meanwhile (then the failures belong to an older definition)."""
        paused, taken = await transient.retry(
            lambda: self._pause_in_store(occ, count), what="auto-pause", stopping=self.stopping
        )
        member = keys.member(occ.namespace, occ.id)
        await transient.retry(
            lambda: self._park(occ.shard, member, paused),
            what="auto-pause index",
            stopping=self.stopping,
        )
        if paused is None:
            return None
        await self._answer(taken)
        metrics.AUTO_PAUSED.labels(metrics.NAMESPACES(occ.namespace)).inc()
        log.warning(
            "schedule paused after consecutive failures",
            extra={"action": "auto_paused", "schedule": member, "failures": count},
        )
        await self.events.send(
            occ.namespace,
            "paused",
            {
                "namespace": occ.namespace,
                "id": occ.id,
                "outcome": "paused",
                "reason": "failures",
                "consecutive_failures": count,
                "version": paused.version,
                "at": timefmt.format_ms(int(time.time() * 1000)),
            },
        )
        return paused.version

    async def _answer(self, taken: dict[int, int]) -> None:
        """The pause's position: recorded in Redis after its park (a replica that has it has
        the park), then answered in PostgreSQL, so that the dispatchers fence a shard whose
        index lost the park (as they do for a pause command)."""
        await transient.retry(
            lambda: self.index.advance(taken, "note"),
            what="auto-pause position",
            stopping=self.stopping,
        )
        await transient.retry(
            lambda: positions.mark_answered(self.store.pool, taken),
            what="auto-pause answered",
            stopping=self.stopping,
        )

    async def _park(self, shard: int, member: str, paused: NewScheduleRow | None) -> None:
        if paused is not None:
            await self.index.upsert(
                {shard: [Upsert(member, paused.version, paused.compact, "park", None)]}
            )
        # A resume starts a fresh count; so does a definition changed meanwhile.
        await self.index.count_failures({shard: [(member, "clear")]})

    async def _pause_in_store(
        self, occ: Occurrence, count: int
    ) -> tuple[NewScheduleRow | None, dict[int, int]]:
        """The pause in PostgreSQL, and the shard position it took ({} when not paused)."""
        paused: NewScheduleRow | None = None
        taken: dict[int, int] = {}
        async with self.store.transaction() as conn:
            row = await self.store.lock_schedule(conn, occ.namespace, occ.id)
            if row is not None and row.state == "active" and row.version == occ.plan.version:
                version = row.version + 1
                paused = NewScheduleRow(
                    row.namespace,
                    row.id,
                    version,
                    "paused",
                    {**row.definition, "paused": True},
                    compact.with_version(row.compact, version),
                    row.priority,
                    row.labels,
                    row.fires,
                    row.last_fire_ms,
                    None,
                )
                await self.store.put_schedule(conn, paused)
                await self.store.mark_paused_for_failures(conn, row.namespace, row.id, version)
                await self.store.record_command(
                    CommandAudit(
                        namespace=row.namespace,
                        verb="pause",
                        schedule_id=row.id,
                        outcome="ok",
                        body={"id": row.id, "reason": "failures", "consecutive_failures": count},
                        version=version,
                        app_id="cronbus-executor",
                    ),
                    conn,
                )
                taken = await positions.take(conn, [(row.namespace, row.id, occ.shard)])
        return paused, taken

    async def drain(self) -> None:
        await self._counts.drain()
