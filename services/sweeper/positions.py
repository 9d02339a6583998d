"""Position replay (invariant 9): each shard of the index brought up to what PostgreSQL has
committed, by replaying exactly the rows changed after the shard's position, with their
pending triggers and backfills.

An index goes behind PostgreSQL when Redis fails over to a replica that lagged, or comes back
from an older snapshot, and (for a moment) when an intake stopped between its commit and its
index writes. Dispatchers claim nothing from a shard behind a command already answered; this
replay is what lets them claim again, usually within one check.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping

from services.sweeper import backfills, pending
from services.sweeper.rebuild import same_servers
from services.sweeper.repair import Repairs
from shared.contract.entries import Upsert
from shared.postgres import positions
from shared.runtime import metrics, transient

# The sweeper's log lines keep one logger name, whichever module writes them.
log = logging.getLogger("services.sweeper.sweeper")


class PositionReplay(Repairs):
    """The sweeper's position checks (a part of ``Sweeper``)."""

    async def keep_positions(self) -> None:
        """One position check; an error other than an outage is logged and the next round
        tries again. A shard fenced behind an answered command fires nothing until it is
        replayed: the check must not stop for good (until a restart) on one refusal."""
        try:
            await self.check_positions()
        except transient.ERRORS:
            raise
        except Exception:
            log.exception(
                "position check failed; trying again", extra={"action": "position_check_failed"}
            )

    async def check_positions(self) -> int:
        """Replay the rows each lagging shard lacks, then move its position on; returns the
        rows replayed. An index being rebuilt is left to the rebuild (it sets the positions
        it starts from)."""
        if not await self.index.client.exists(self.index.keys.epoch):
            return 0
        # PostgreSQL first: the rows read next include every change up to these positions.
        committed = {
            shard: p.committed
            for shard, p in (await positions.read(self.store.pool)).items()
            if shard < self.settings.shards
        }
        held = await self.index.positions()
        behind = {s: held[s] for s, c in committed.items() if held.get(s, 0) < c}
        if not behind:
            return 0
        started = time.monotonic()
        servers = await self._redis_servers()
        rows = await positions.changed_after(self.store.pool, behind)
        batch = self.settings.rebuild_batch
        for start in range(0, len(rows), batch):
            await self.reconcile(rows[start : start + batch])
        runs = await self.replay_runs(behind)
        if not same_servers(servers, await self._redis_servers()):
            # Another server answers now (a failover meanwhile): it may lack the replay.
            return 0
        await self.index.advance({s: committed[s] for s in behind}, "floor")
        metrics.POSITION_REPLAYS.inc(len(behind))
        metrics.POSITION_REPLAYED_ROWS.inc(len(rows))
        log.warning(
            "index behind PostgreSQL: changes replayed",
            extra={
                "action": "positions_replayed",
                "shards": len(behind),
                "rows": len(rows),
                "runs": runs,
                "lag": sum(committed[s] - p for s, p in behind.items()),
                "duration_s": round(time.monotonic() - started, 3),
            },
        )
        return len(rows)

    async def replay_runs(self, behind: Mapping[int, int]) -> int:
        """The pending triggers and the backfills whose own position is after their shard's,
        written with that position unless it is applied already (``run.lua``,
        ``backfill.lua``): an intake that wrote it first, or one still on its way to Redis,
        is never doubled (a run it wrote may have been delivered since). One that ran to
        completion has no row left. Returns how many were written."""
        written = 0
        runs = await positions.runs_after(self.store.pool, behind)
        parks: dict[int, list[Upsert]] = defaultdict(list)
        for row, _ in runs:
            park = pending.schedule_park(row)
            if park is not None:
                parks[self.index.shard_of(row.run.namespace, row.run.id)].append(park)
        if parks:
            await self.index.upsert(dict(parks))
        for row, position in runs:
            member = pending.member_of(row.run)
            if member is not None:
                shard = self.index.shard_of(row.run.namespace, row.run.id)
                added = await self.index.add_run(shard, member, row.run.nominal_ms, position)
                written += int(added)
        for kept, position in await positions.backfills_after(self.store.pool, behind):
            shard = self.index.shard_of(kept.namespace, kept.id)
            started = await self.index.start_backfill(shard, backfills.start_of(kept), position)
            written += int(started)
        return written

    async def foreign_index(self) -> bool:
        """Whether the index belongs to another database (binding it to this one when it
        records none, as after Redis lost its data): such an index is never rebuilt into,
        replayed or fired."""
        identity = await positions.database_identity(self.store.pool)
        foreign = await self.index.bind(identity)
        if foreign is None:
            return False
        log.error(
            "the index belongs to another database: not touching it "
            "(check CRONBUS_REDIS_URL and CRONBUS_REDIS_PREFIX)",
            extra={"action": "foreign_index", "database": identity, "index_of": foreign},
        )
        return True

    async def start_positions(self) -> None:
        """A rebuild starts: a shard with no position yet (an empty index) takes the one
        PostgreSQL has committed now, read before any row is streamed: every row the rebuild
        writes is that change or a later one. A shard that kept its position (what Redis
        held survived) keeps it, and the position check replays what it lacks."""
        committed = {
            shard: p.committed
            for shard, p in (await positions.read(self.store.pool)).items()
            if shard < self.settings.shards
        }
        if committed:
            await self.index.advance(committed, "start")
