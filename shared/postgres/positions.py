"""Positions of the index in PostgreSQL (invariant 9: an answered command is never undone by
Redis).

Each shard of the index has a position: the count of transactions that changed one of its
schedules. The intake takes the next one inside the transaction of the change and stamps the
rows it wrote; the reply waits until Redis has applied it and ``answered`` says so. A Redis
found behind ``answered`` (a failover to a lagging replica, an older snapshot) is fenced by the
dispatchers, and the sweeper replays the rows after its position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import asyncpg

from shared.contract.rows import LiveBackfill, LiveSchedule, PendingRun, PendingRunRow
from shared.postgres.sql import QUERIES

#: A connection, pooled or not.
Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


@dataclass(frozen=True, slots=True)
class ShardPosition:
    """What PostgreSQL holds of one shard: positions committed, and answered ok."""

    committed: int
    answered: int


async def take(conn: Connection, stamps: Sequence[tuple[str, str, int]]) -> dict[int, int]:
    """In the transaction of a change: the next position of each shard of these
    (namespace, id, shard) rows, the rows stamped with it. Returns shard -> position."""
    if not stamps:
        return {}
    shards = sorted({shard for _, _, shard in stamps})
    records = await conn.fetch(
        QUERIES["take_positions"],
        shards,
        [ns for ns, _, _ in stamps],
        [i for _, i, _ in stamps],
        [shard for _, _, shard in stamps],
    )
    return {int(r["shard"]): int(r["committed"]) for r in records}


#: The channel ``mark_answered`` notifies, in the transaction that raises ``answered``: every
#: dispatcher listens, so that one holding a shard fences its claims with a position another
#: dispatcher answered within milliseconds, not at its next read of the table.
ANSWERED_CHANNEL = "cronbus_answered"


#: PostgreSQL refuses a notification payload of 8000 bytes or more.
MAX_PAYLOAD_BYTES = 7000


def answered_payloads(positions: Mapping[int, int]) -> list[str]:
    """``shard:position,...``: what the notifications on ``ANSWERED_CHANNEL`` carry, split so
    that each stays under PostgreSQL's limit (a group commit may touch every shard)."""
    payloads: list[str] = []
    parts: list[str] = []
    size = 0
    for shard, position in sorted(positions.items()):
        part = f"{shard}:{position}"
        if parts and size + len(part) + 1 > MAX_PAYLOAD_BYTES:
            payloads.append(",".join(parts))
            parts, size = [], 0
        parts.append(part)
        size += len(part) + 1
    if parts:
        payloads.append(",".join(parts))
    return payloads


def parse_answered(payload: str) -> dict[int, int]:
    """The positions of a notification; a malformed part is skipped (the next read of the
    table has it anyway)."""
    found: dict[int, int] = {}
    for part in payload.split(","):
        shard, _, position = part.partition(":")
        if shard.isdigit() and position.isdigit():
            found[int(shard)] = int(position)
    return found


async def mark_answered(pool: asyncpg.Pool, positions: Mapping[int, int]) -> None:
    """These positions are applied in Redis and about to be answered ok; the dispatchers are
    told at the commit (``ANSWERED_CHANNEL``)."""
    if not positions:
        return
    shards = sorted(positions)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(QUERIES["mark_answered"], shards, [positions[s] for s in shards])
        for payload in answered_payloads(positions):
            await conn.execute(QUERIES["notify_answered"], ANSWERED_CHANNEL, payload)


async def of_schedules(
    conn: Connection | asyncpg.Pool, members: Sequence[tuple[str, str]]
) -> dict[int, int]:
    """Per shard, the position of the last change of these (namespace, id) schedules."""
    if not members:
        return {}
    records = await conn.fetch(
        QUERIES["positions_of_schedules"], [ns for ns, _ in members], [i for _, i in members]
    )
    return {int(r["shard"]): int(r["position"]) for r in records}


def highest(*found: Mapping[int, int]) -> dict[int, int]:
    """Per shard, the highest of these positions."""
    out: dict[int, int] = {}
    for positions in found:
        for shard, position in positions.items():
            out[shard] = max(out.get(shard, 0), position)
    return out


async def read(pool: asyncpg.Pool) -> dict[int, ShardPosition]:
    """Every shard's committed and answered positions (a shard never changed is absent)."""
    records = await pool.fetch(QUERIES["index_positions"])
    return {
        int(r["shard"]): ShardPosition(int(r["committed"]), int(r["answered"])) for r in records
    }


async def changed_after(pool: asyncpg.Pool, after: Mapping[int, int]) -> list[LiveSchedule]:
    """The rows of these shards changed after each one's position, oldest change first."""
    if not after:
        return []
    shards = sorted(after)
    records = await pool.fetch(
        QUERIES["changed_after_positions"], shards, [after[s] for s in shards]
    )
    return [LiveSchedule.of(r) for r in records]


async def stamp_run(conn: Connection, run: PendingRun, position: int) -> None:
    """In the transaction that added it: the pending run keeps the position taken there."""
    await conn.execute(
        QUERIES["stamp_run_position"], run.namespace, run.id, run.kind, run.nominal_ms, position
    )


async def stamp_backfill(conn: Connection, namespace: str, schedule_id: str, position: int) -> None:
    """In the transaction that started it: the backfill keeps the position taken there."""
    await conn.execute(QUERIES["stamp_backfill_position"], namespace, schedule_id, position)


async def runs_after(
    pool: asyncpg.Pool, after: Mapping[int, int]
) -> list[tuple[PendingRunRow, int]]:
    """The pending runs (triggers) of live schedules of these shards whose own position is
    after the shard's, each with its position."""
    if not after:
        return []
    shards = sorted(after)
    records = await pool.fetch(QUERIES["runs_after_positions"], shards, [after[s] for s in shards])
    return [(PendingRunRow.of(r), int(r["position"])) for r in records]


async def backfills_after(
    pool: asyncpg.Pool, after: Mapping[int, int]
) -> list[tuple[LiveBackfill, int]]:
    """The backfills of schedules in rotation or paused of these shards whose own position
    is after the shard's, each with its position."""
    if not after:
        return []
    shards = sorted(after)
    records = await pool.fetch(
        QUERIES["backfills_after_positions"], shards, [after[s] for s in shards]
    )
    return [(LiveBackfill.of(r), int(r["position"])) for r in records]


async def database_identity(pool: asyncpg.Pool) -> str:
    """``<system identifier>/<database name>``: which database an index belongs to."""
    return str(await pool.fetchval(QUERIES["database_identity"]))
