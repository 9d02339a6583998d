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

from shared.contract.rows import LiveSchedule
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


async def mark_answered(pool: asyncpg.Pool, positions: Mapping[int, int]) -> None:
    """These positions are applied in Redis and about to be answered ok."""
    if not positions:
        return
    shards = sorted(positions)
    await pool.execute(QUERIES["mark_answered"], shards, [positions[s] for s in shards])


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


async def database_identity(pool: asyncpg.Pool) -> str:
    """``<system identifier>/<database name>``: which database an index belongs to."""
    return str(await pool.fetchval(QUERIES["database_identity"]))
