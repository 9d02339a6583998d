"""Drift repair: the index brought back in line with PostgreSQL, a slice of the rolling full
comparison at each check, recently changed schedules first; tombstones trimmed once PostgreSQL
agrees they are settled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from services.sweeper import drift
from services.sweeper.rebuild import Rebuilding, entry_of, group_by_shard
from shared.contract import keys
from shared.contract.entries import Upsert
from shared.contract.rows import Checkpoint, LiveSchedule
from shared.rules import compact
from shared.rules.plan import same_rotation
from shared.runtime import metrics
from shared.runtime.readahead import read_ahead

# The sweeper's log lines keep one logger name, whichever module writes them.
log = logging.getLogger("services.sweeper.sweeper")

#: Drift repair looks this far behind the previous check, on PostgreSQL's clock: a row is
#: stamped when its transaction starts, and may commit a little later.
DRIFT_OVERLAP_MS = 10_000
#: Members read from Redis per round trip during a full drift scan.
SCAN_BATCH = 1000
#: How often tombstones are looked at (ms).
TOMBSTONE_CHECK_MS = 60_000
#: Tombstones are kept at least this long: past any rebuild or repair that read PostgreSQL
#: before the delete or the finish they record.
TOMBSTONE_KEEP_MS = 600_000


def _finished_checkpoint(row: LiveSchedule) -> Checkpoint:
    """The checkpoint a schedule finished in Redis should have written to PostgreSQL."""
    last = row.next_fire_ms if row.next_fire_ms is not None else row.last_fire_ms
    return Checkpoint(
        row.namespace, row.id, last or 0, None, row.fires + 1, finished=True, version=row.version
    )


class Repairs(Rebuilding):
    """The sweeper's drift repair and tombstone trimming (a part of ``Sweeper``)."""

    slice_min: int
    _last_drift_ms: int
    _drift_since_ms: int | None
    _rows_after: tuple[str, str]
    _entries_at: tuple[int, int]
    _last_tombstones_ms: int

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
            entry = entry_of(row, now)
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
        codes = await self.index.upsert(group_by_shard(repairs))
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
