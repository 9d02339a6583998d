"""``cronbus migrate`` against the real PostgreSQL: creates the database, then is idempotent."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from shared.postgres import db
from tests.support import services

CATALOG = """
SELECT c.relname, c.relkind, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE n.nspname = 'public'
ORDER BY 1, 3
"""


@pytest.fixture
async def fresh_url(endpoints: services.Endpoints) -> AsyncIterator[str]:
    name = services.unique("cronbus_m_")
    yield services.with_database(endpoints.database_url, name)
    conn = await asyncpg.connect(endpoints.database_url)
    await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await conn.close()


async def catalog(url: str) -> list[tuple[object, ...]]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(row) for row in await conn.fetch(CATALOG)]
    finally:
        await conn.close()


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "cronbus"
    return subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=False,
    )


async def test_migrate_creates_the_database_and_a_second_run_changes_nothing(
    fresh_url: str,
) -> None:
    first = run_cli("migrate", env={"CRONBUS_DATABASE_URL": fresh_url})
    assert first.returncode == 0, first.stderr
    assert "0001_initial" in first.stdout and "0002_pending_runs" in first.stdout
    before = await catalog(fresh_url)
    tables = {row[0] for row in before}
    assert {
        "schedules",
        "executions",
        "executions_default",
        "commands",
        "pending_runs",
        "schema_migrations",
    } <= tables
    today = dt.datetime.now(dt.UTC).date()
    assert db.partition_name(today) in tables

    second = run_cli("migrate", env={"CRONBUS_DATABASE_URL": fresh_url})
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "up to date"
    assert await catalog(fresh_url) == before


async def test_executions_are_partitioned_by_day_and_unique_per_occurrence(
    database_url: str,
) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        insert = """INSERT INTO executions (namespace, id, nominal_at, attempts, status,
                        idempotency_key, started_at, finished_at, lateness_ms)
                    VALUES ('ns', 'a', $1, 1, 'succeeded', 'k', now(), now(), 0)"""
        now = dt.datetime.now(dt.UTC)
        await conn.execute(insert, now)
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.execute(insert, now)
        # A trigger at that very instant is another occurrence, with a row of its own.
        await conn.execute(
            """INSERT INTO executions (namespace, id, nominal_at, is_trigger, attempts, status,
                   idempotency_key, started_at, finished_at, lateness_ms)
               VALUES ('ns', 'a', $1, true, 1, 'succeeded', 'k2', now(), now(), 0)""",
            now,
        )
        assert await conn.fetchval("SELECT count(*) FROM executions WHERE id = 'a'") == 2
        where = await conn.fetchval(
            "SELECT tableoid::regclass::text FROM executions WHERE id = 'a'"
        )
        assert where == db.partition_name(now.date())
        # A row far outside the daily partitions lands in the default one, and is moved into
        # its day's partition when that partition is created.
        old = now - dt.timedelta(days=30)
        await conn.execute(insert.replace("'a'", "'old'"), old)
        assert (
            await conn.fetchval("SELECT tableoid::regclass::text FROM executions WHERE id = 'old'")
            == "executions_default"
        )
        await db.ensure_partitions(conn, old.date(), ahead_days=0, behind_days=0)
        assert await conn.fetchval(
            "SELECT tableoid::regclass::text FROM executions WHERE id = 'old'"
        ) == db.partition_name(old.date())
        dropped = await db.drop_partitions_before(conn, old.date() + dt.timedelta(days=1))
        assert dropped == [db.partition_name(old.date())]
        assert await conn.fetchval("SELECT count(*) FROM executions WHERE id = 'old'") == 0
        assert await conn.fetchval("SELECT count(*) FROM executions WHERE id = 'a'") == 2
    finally:
        await conn.close()
