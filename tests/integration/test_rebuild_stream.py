"""The rebuild's stream of live schedules: every one, highest priority first, from the index."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from shared.contract import codec, validation
from shared.contract.models import MAX_PRIORITY
from shared.policy import netpolicy
from shared.postgres import bulk, db
from shared.postgres.sql import QUERIES
from shared.postgres.store import ABOVE_ANY_PRIORITY, Connection, Store
from shared.redis.index import Index
from tests.support import services

LOCAL = validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK)

#: A whole-table ORDER BY, as the stream was read before it went by pages.
WHOLE_TABLE = """
SELECT namespace, id FROM schedules WHERE state IN ('active', 'paused')
ORDER BY priority DESC, namespace, id
"""


def schedule(schedule_id: str, priority: int, **extra: Any) -> bytes:
    return codec.dumps(
        {
            "id": schedule_id,
            "spec": {"kind": "interval", "every_s": 3600},
            "target": {"kind": "webhook", "url": "http://127.0.0.1:9/x"},
            "priority": priority,
            **extra,
        }
    )


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 1000])
async def test_the_stream_yields_every_live_schedule_once_highest_priority_first(
    store: Store, index: Index, batch: int
) -> None:
    priorities = [MAX_PRIORITY, 7, 0, 0, 0, -3, -MAX_PRIORITY]
    for namespace in ("zz", "aa", "mm"):
        lines = [schedule(f"s{n}", p) for n, p in enumerate(priorities)]
        lines.append(schedule("held", 7, paused=True))
        result = await bulk.import_lines(lines, namespace, store, index, LOCAL, workers=1)
        assert not result.refused, result.refused
    async with store.transaction() as conn:
        await conn.execute("UPDATE schedules SET state = 'deleted' WHERE id = 's3'")
        await conn.execute("UPDATE schedules SET state = 'completed' WHERE id = 's4'")

    streamed = [(s.namespace, s.id) async for chunk in store.live_schedules(batch) for s in chunk]
    chunks = [len(chunk) async for chunk in store.live_schedules(batch)]

    by_priority = {f"s{n}": p for n, p in enumerate(priorities)} | {"held": 7}
    live = [(ns, i) for ns in ("zz", "aa", "mm") for i in by_priority if i not in ("s3", "s4")]
    expected = sorted(live, key=lambda key: (-by_priority[key[1]], key[0], key[1]))
    assert streamed == expected
    assert all(0 < size <= batch for size in chunks)


async def plan(conn: Connection, query: str, *args: object) -> str:
    found = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {query}", *args)
    # The store's pool decodes json itself; a plain connection returns the text.
    return found if isinstance(found, str) else json.dumps(found)


async def test_each_page_is_read_in_order_from_the_index_even_without_statistics(
    store: Store,
) -> None:
    # A table filled in bulk and never analysed (autovacuum may be off, or not have come by):
    # the planner knows its size only from its pages. A whole-table ORDER BY is then planned
    # as a sort of every row, which at 10,000,000 rows outlasted the statement timeout.
    async with store.transaction() as conn:
        # Kept so for the test's own database, whatever the server's autovacuum does.
        await conn.execute("ALTER TABLE schedules SET (autovacuum_enabled = false)")
        await conn.execute(
            "INSERT INTO schedules (namespace, id, version, state, definition, compact, priority) "
            "SELECT 'ns' || (g % 7), 's' || g, 1, 'active', '{}', '\\x00', g % 3 "
            "FROM generate_series(1, 200000) g"
        )
    async with store.pool.acquire() as conn:
        whole = await plan(conn, WHOLE_TABLE)
        page = await plan(conn, QUERIES["live_schedules_page"], 1, "ns3", "s500", 1000)
        top = await plan(conn, QUERIES["live_priority_below"], ABOVE_ANY_PRIORITY)
    # The set-up reproduces what went wrong: this is the plan the stream no longer uses.
    assert '"Sort"' in whole, whole
    for query_plan in (page, top):
        assert '"Sort"' not in query_plan and "schedules_rebuild" in query_plan, query_plan


async def test_a_row_past_the_model_s_priority_bounds_is_streamed_too(store: Store) -> None:
    # The column has no bound of its own: a row written by hand, or by a release whose bounds
    # were wider, is live all the same, and a rebuild that skipped it would never fire it.
    async with store.transaction() as conn:
        await conn.execute(
            "INSERT INTO schedules (namespace, id, version, state, definition, compact, priority) "
            "VALUES ('ns', 'high', 1, 'active', '{}', '\\x00', $1), "
            "('ns', 'low', 1, 'active', '{}', '\\x00', $2), "
            "('ns', 'mid', 1, 'active', '{}', '\\x00', 0)",
            MAX_PRIORITY + 1,
            -MAX_PRIORITY - 1,
        )
    streamed = [s.id async for chunk in store.live_schedules(10) for s in chunk]
    assert streamed == ["high", "mid", "low"]


#: Keys whose order under a linguistic collation is not their code point order.
ODD_KEYS = [
    (ns, i)
    for ns in ("a-b", "ab", "a_b", "b")
    for i in ("a", "A", "a-b", "a.b", "a:b", "a@b", "a_b", "ab", "a-", "B", "b", "1", "a1", "Z-z")
]


@pytest.fixture
async def icu_store(endpoints: services.Endpoints) -> AsyncIterator[Store]:
    """A store whose database sorts text by the ICU en-US collation (not C, as the tests'
    databases do), as a server initialised with a language's locale would."""
    name = services.unique("cronbus_icu_")
    admin = await asyncpg.connect(endpoints.database_url)
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_collation WHERE collprovider = 'i'"):
            pytest.skip("this PostgreSQL has no ICU collations")
        await admin.execute(
            f'CREATE DATABASE "{name}" TEMPLATE template0 LOCALE_PROVIDER icu '
            "ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
        )
        url = services.with_database(endpoints.database_url, name)
        await db.migrate(url)
        store = await Store.open(url)
        try:
            yield store
        finally:
            await store.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.mark.parametrize("batch", [1, 2, 3, 5])
async def test_pages_under_a_linguistic_collation_neither_skip_nor_repeat(
    icu_store: Store, batch: int
) -> None:
    async with icu_store.transaction() as conn:
        await conn.executemany(
            "INSERT INTO schedules (namespace, id, version, state, definition, compact, priority) "
            "VALUES ($1, $2, 1, 'active', '{}', '\\x00', $3)",
            [(ns, i, n % 2) for n, (ns, i) in enumerate(ODD_KEYS)],
        )
        whole = [(r["namespace"], r["id"]) for r in await conn.fetch(WHOLE_TABLE)]
    streamed = [
        (s.namespace, s.id) async for chunk in icu_store.live_schedules(batch) for s in chunk
    ]
    # The database's order, not Python's: the collation puts "a" before "A" before "a-b".
    assert [k for k in whole if k[0] == "a-b"][:3] != sorted(k for k in whole if k[0] == "a-b")[:3]
    assert streamed == whole
