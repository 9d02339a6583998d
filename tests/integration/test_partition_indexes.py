"""Migration 0008's index on executions is built partition by partition, CONCURRENTLY, so an
upgrade of a large table does not stop the executors' writes while it reads every row."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator

import asyncpg
import pytest

from shared.postgres import db, sql
from tests.conftest import _drop_database
from tests.support import services


@pytest.fixture
async def empty_database(endpoints: services.Endpoints) -> AsyncIterator[str]:
    name = services.unique("cronbus_upgrade_")
    yield services.with_database(endpoints.database_url, name)
    await _drop_database(endpoints.database_url, name)


async def _partitions(conn: asyncpg.Connection) -> set[str]:
    return {
        row["relname"]
        for row in await conn.fetch(
            """SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = 'executions'::regclass"""
        )
    }


async def _index_state(conn: asyncpg.Connection) -> tuple[bool, set[str]]:
    valid = await conn.fetchval(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'executions_retried'::regclass"
    )
    covered = {
        row["relname"]
        for row in await conn.fetch(
            """SELECT p.relname FROM pg_inherits ih
               JOIN pg_index pi ON pi.indexrelid = ih.inhrelid
               JOIN pg_class p ON p.oid = pi.indrelid
               WHERE ih.inhparent = 'executions_retried'::regclass"""
        )
    }
    return valid, covered


async def _at_version_7_with_rows(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    every = sql.migrations()
    monkeypatch.setattr(sql, "migrations", lambda: [m for m in every if m[0] < 8])
    await db.migrate(url, partitions_ahead_days=2)
    monkeypatch.setattr(sql, "migrations", lambda: every)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            """INSERT INTO executions (namespace, id, nominal_at, is_trigger, attempts, status,
                                      idempotency_key, started_at, finished_at, lateness_ms)
               SELECT 'ns', 's' || n, now() - n * interval '1 minute', false, 2, 'succeeded',
                      'k' || n, now(), now(), 5
               FROM generate_series(1, 500) AS n"""
        )
    finally:
        await conn.close()


async def test_the_migration_itself_reads_no_partition_and_the_migrator_builds_them(
    empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _at_version_7_with_rows(empty_database, monkeypatch)
    conn = await asyncpg.connect(empty_database)
    try:
        # The migration's own transaction (the part that would hold a lock while it reads
        # every row) only declares the index on the parent.
        await db._apply_pending(conn)
        valid, covered = await _index_state(conn)
        assert not valid and covered == set()
        # The migrator then builds each partition's, concurrently, and attaches it.
        built = await db.build_partition_indexes(conn)
        valid, covered = await _index_state(conn)
        assert valid and covered == await _partitions(conn) and len(built) == len(covered)
    finally:
        await conn.close()


async def test_an_upgrade_indexes_every_existing_partition_and_new_ones(
    empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _at_version_7_with_rows(empty_database, monkeypatch)
    # Three services starting at once each run the migrator.
    results = await asyncio.gather(*(db.migrate(empty_database) for _ in range(3)))
    assert sorted(results) == [
        [],
        [],
        [
            "0008_attempts_and_rates",
            "0009_index_positions",
            "0010_audit_barrier",
            "0011_run_positions",
        ],
    ]
    conn = await asyncpg.connect(empty_database)
    try:
        valid, covered = await _index_state(conn)
        assert valid and covered == await _partitions(conn)
        assert len(covered) >= 5  # yesterday's to today + 2 days', and the default partition

        # A partition created later gets its index when it is attached.
        later = dt.datetime.now(dt.UTC).date() + dt.timedelta(days=5)
        await db.ensure_partitions(conn, later, 0, 0)
        valid, covered = await _index_state(conn)
        assert valid and db.partition_name(later) in covered
    finally:
        await conn.close()


async def test_a_build_cancelled_half_way_is_built_again(
    empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _at_version_7_with_rows(empty_database, monkeypatch)
    conn = await asyncpg.connect(empty_database)
    try:
        await db._apply_pending(conn)
        # What a cancelled CREATE INDEX CONCURRENTLY leaves: the index, invalid, unattached.
        victim = sorted(await _partitions(conn))[0]
        name = f"{victim}_executions_retried"
        await conn.execute(f'CREATE INDEX "{name}" ON "{victim}" (finished_at)')
        await conn.execute(
            "UPDATE pg_index SET indisvalid = false WHERE indexrelid = $1::regclass", name
        )
        await db.build_partition_indexes(conn)
        valid, covered = await _index_state(conn)
        assert valid and victim in covered
        definition = await conn.fetchval("SELECT pg_get_indexdef($1::regclass)", name)
        assert "finished_at DESC, namespace" in definition  # rebuilt, not the leftover
    finally:
        await conn.close()
