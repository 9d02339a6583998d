"""PostgreSQL: connections, ``cronbus migrate`` and the daily partitions of ``executions``."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from shared.postgres import sql

log = logging.getLogger(__name__)

#: A connection, pooled or not.
Connection = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

#: Serialises migrators (several services may start at once).
_MIGRATION_LOCK = 0x63726F6E62757301


def split_database_url(url: str) -> tuple[str, str]:
    """(URL of the same server's ``postgres`` database, name of the target database)."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "postgres"
    maintenance = urlunsplit((parts.scheme, parts.netloc, "/postgres", parts.query, ""))
    return maintenance, name


async def ensure_database(url: str) -> bool:
    """Create the database if it is missing; True when it was created."""
    maintenance, name = split_database_url(url)
    conn = await asyncpg.connect(maintenance)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if exists:
            return False
        try:
            await conn.execute(f'CREATE DATABASE "{name.replace(chr(34), "")}"')
        except (asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError):
            return False  # another migrator won the race
        return True
    finally:
        await conn.close()


async def migrate(url: str, *, partitions_ahead_days: int = 3) -> list[str]:
    """Create the database when missing and apply the migrations it has not seen, in order.

    Idempotent: a second run applies nothing. Returns the names of the migrations applied.
    """
    await ensure_database(url)
    conn = await asyncpg.connect(url)
    try:
        await _take_migration_lock(conn)
        try:
            applied = await _apply_pending(conn)
            await build_partition_indexes(conn)
            await ensure_partitions(conn, dt.datetime.now(dt.UTC).date(), partitions_ahead_days)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _MIGRATION_LOCK)
    finally:
        await conn.close()
    return applied


async def _take_migration_lock(conn: Connection) -> None:
    """Wait for the migration lock by asking again, never inside a waiting statement: a
    migrator blocked in ``pg_advisory_lock`` holds a snapshot, and CREATE INDEX CONCURRENTLY
    in the migrator holding the lock waits for every such snapshot (each would wait for the
    other; PostgreSQL ends it as a deadlock)."""
    while True:
        if await conn.fetchval("SELECT pg_try_advisory_lock($1)", _MIGRATION_LOCK):
            return
        await asyncio.sleep(0.2)


async def _apply_pending(conn: Connection) -> list[str]:
    await conn.execute(
        """CREATE TABLE IF NOT EXISTS schema_migrations (
               version integer PRIMARY KEY,
               name text NOT NULL,
               applied_at timestamptz NOT NULL DEFAULT now())"""
    )
    done = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")}
    applied = []
    for number, name, text in sql.migrations():
        if number in done:
            continue
        async with conn.transaction():
            await conn.execute(text)
            await conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", number, name
            )
        log.info("migration applied", extra={"action": "migration_applied", "migration": name})
        applied.append(f"{number:04d}_{name}")
    return applied


async def build_partition_indexes(conn: Connection) -> list[str]:
    """Finish the indexes a migration declared ``ON ONLY executions``: build each partition's
    CONCURRENTLY (outside any transaction: writes go on) and attach it; the parent's index is
    valid once every partition has a valid one. An interrupted run is resumed: an invalid
    index it left (a build cancelled half way) is dropped and built again."""
    built = []
    for index in await conn.fetch(_UNFINISHED_INDEXES):
        for part in await conn.fetch(_PARTITIONS_WITHOUT_VALID_INDEX, index["oid"]):
            name = f"{part['relname']}_{index['name']}"[:63]
            if part["leftover_valid"] is False:  # a build cancelled half way
                await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {_quoted(name)}")
            if not part["leftover_valid"]:
                statement, found = _ONLY_PARENT.subn(
                    f"CREATE INDEX CONCURRENTLY {_quoted(name)} ON {_quoted(part['relname'])} ",
                    index["def"],
                    count=1,
                )
                if not found:
                    raise RuntimeError(f"cannot build the index {index['name']} by partition")
                await conn.execute(statement)
            await conn.execute(
                f"ALTER INDEX {_quoted(index['name'])} ATTACH PARTITION {_quoted(name)}"
            )
            built.append(name)
    left = [row["name"] for row in await conn.fetch(_UNFINISHED_INDEXES)]
    if left:
        raise RuntimeError(f"indexes still invalid after building them by partition: {left}")
    return built


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


#: Invalid partitioned indexes of executions: declared ON ONLY, partitions still to do.
_UNFINISHED_INDEXES = """
    SELECT i.indexrelid AS oid, c.relname AS name, pg_get_indexdef(i.indexrelid) AS def
    FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE i.indrelid = 'executions'::regclass AND NOT i.indisvalid AND c.relkind = 'I'"""

#: Partitions of executions with no index attached to the partitioned index $1, and whether
#: an interrupted run left the partition's index unattached: valid (the attach is left to do),
#: invalid (the build was cancelled: built again), or NULL (none).
_PARTITIONS_WITHOUT_VALID_INDEX = """
    SELECT p.relname,
           (SELECT pi.indisvalid FROM pg_index pi JOIN pg_class c ON c.oid = pi.indexrelid
            WHERE pi.indrelid = p.oid
              AND c.relname = left(p.relname || '_' || (SELECT relname FROM pg_class
                                                       WHERE oid = $1), 63)) AS leftover_valid
    FROM pg_inherits h JOIN pg_class p ON p.oid = h.inhrelid
    WHERE h.inhparent = 'executions'::regclass
      AND NOT EXISTS (
          SELECT 1 FROM pg_inherits ih JOIN pg_index pi ON pi.indexrelid = ih.inhrelid
          WHERE ih.inhparent = $1 AND pi.indrelid = p.oid)
    ORDER BY p.relname"""

#: The head of a partitioned index's definition, as ``pg_get_indexdef`` writes it.
_ONLY_PARENT = re.compile(r"^CREATE INDEX \S+ ON ONLY \S+ ")


def partition_name(day: dt.date) -> str:
    return f"executions_p{day:%Y%m%d}"


async def ensure_partitions(
    conn: Connection, today: dt.date, ahead_days: int, behind_days: int = 1
) -> list[str]:
    """Create the daily partitions of ``executions`` from ``today - behind`` to ``today + ahead``.

    Rows that already fell into the default partition for such a day are moved into it, so the
    partition can be attached (PostgreSQL refuses otherwise).
    """
    existing = {
        row["relname"]
        for row in await conn.fetch(
            """SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = 'executions'::regclass"""
        )
    }
    created = []
    for offset in range(-behind_days, ahead_days + 1):
        day = today + dt.timedelta(days=offset)
        name = partition_name(day)
        if name in existing:
            continue
        await _create_partition(conn, name, day)
        created.append(name)
    return created


async def _create_partition(conn: Connection, name: str, day: dt.date) -> None:
    low, high = day.isoformat(), (day + dt.timedelta(days=1)).isoformat()
    async with conn.transaction():
        await conn.execute(f"CREATE TABLE {name} (LIKE executions INCLUDING ALL)")
        await conn.execute(
            f"""WITH moved AS (
                    DELETE FROM executions_default
                    WHERE nominal_at >= '{low}' AND nominal_at < '{high}' RETURNING *)
                INSERT INTO {name} SELECT * FROM moved"""
        )
        await conn.execute(
            f"ALTER TABLE executions ATTACH PARTITION {name} "
            f"FOR VALUES FROM ('{low}') TO ('{high}')"
        )


async def drop_partitions_before(conn: Connection, cutoff: dt.date) -> list[str]:
    """Drop whole daily partitions that end on or before ``cutoff`` (retention)."""
    dropped = []
    rows = await conn.fetch(
        """SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
           WHERE i.inhparent = 'executions'::regclass AND c.relname LIKE 'executions_p%'"""
    )
    for row in rows:
        day = dt.datetime.strptime(row["relname"].removeprefix("executions_p"), "%Y%m%d").date()
        if day + dt.timedelta(days=1) <= cutoff:
            await conn.execute(f"DROP TABLE {row['relname']}")
            dropped.append(row["relname"])
    await conn.execute(
        "DELETE FROM executions_default WHERE nominal_at < $1",
        dt.datetime.combine(cutoff, dt.time(), dt.UTC),
    )
    return sorted(dropped)
