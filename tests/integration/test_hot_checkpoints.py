"""The firing path's updates are HOT: no index holds what they change, and pages have room."""

from __future__ import annotations

import time

import asyncpg

from shared.contract import codec, timefmt, validation
from shared.contract.rows import ExecutionRow
from shared.policy import netpolicy, stats
from shared.postgres import bulk
from shared.postgres.columns import stats_arguments
from shared.postgres.sql import QUERIES
from shared.postgres.store import Connection, Store
from shared.redis.index import Index

NOW = int(time.time() * 1000)
LOCAL = validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK)

#: Columns of an index: its keys, and those its expressions and predicate read.
INDEXED_COLUMNS = """
SELECT i.relname AS index, a.attname AS column
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_attribute a ON a.attrelid = x.indrelid
WHERE x.indrelid = $1::regclass
  AND (a.attnum = ANY (x.indkey::int2[])
       OR EXISTS (SELECT 1 FROM pg_depend d
                  WHERE d.classid = 'pg_class'::regclass AND d.objid = x.indexrelid
                    AND d.refclassid = 'pg_class'::regclass AND d.refobjid = x.indrelid
                    AND d.refobjsubid = a.attnum))
"""

#: One row per heap page of a table: a batch of them puts one update on every page.
ONE_PER_PAGE = """
SELECT DISTINCT ON ((ctid::text::point)[0]) id
FROM {table} ORDER BY (ctid::text::point)[0], id
"""

UPDATES = """
SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = $1
"""


def herd_line(i: int) -> bytes:
    # The bench's herd schedule: a definition and its compact form of about 1 KB together.
    return codec.dumps(
        {
            "id": f"h{i:08d}",
            "spec": {
                "kind": "interval",
                "every_s": 3600,
                "start_at": timefmt.format_ms(NOW + 3_600_000),
            },
            "target": {"kind": "webhook", "url": "http://127.0.0.1:9/herd"},
        }
    )


async def updates(conn: Connection, table: str) -> tuple[int, int]:
    """Rows this transaction updated in ``table``, and how many of them were HOT updates."""
    row = await conn.fetchrow(UPDATES, table)
    assert row is not None, table
    return row["n_tup_upd"], row["n_tup_hot_upd"]


async def indexed(conn: asyncpg.Connection, table: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for row in await conn.fetch(INDEXED_COLUMNS, table):
        found.setdefault(row["column"], set()).add(row["index"])
    return found


async def test_no_index_holds_a_column_the_firing_path_updates(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        schedules = await indexed(conn, "schedules")
        # Sanity: the catalog query sees keys, expressions' columns and predicates' columns.
        assert schedules["state"] == {"schedules_rebuild", "schedules_console_state"}
        assert "schedules_labels" in schedules["labels"]
        assert "schedules_pkey" in schedules["id"]
        # write_checkpoints; it changes state only when a rotation completes (not HOT, rare).
        assert not {"last_fire_at", "next_fire_at", "fires"} & schedules.keys()
        # write_stats changes everything but the key.
        assert set(await indexed(conn, "schedule_stats")) == {"namespace", "id"}
        options = {
            row["relname"]: row["reloptions"]
            for row in await conn.fetch(
                """SELECT relname, reloptions FROM pg_class
                   WHERE relname IN ('schedules', 'schedule_stats')"""
            )
        }
        assert options == {"schedules": ["fillfactor=70"], "schedule_stats": ["fillfactor=90"]}
    finally:
        await conn.close()


async def test_a_checkpoint_and_a_stats_update_on_every_page_are_hot(
    database_url: str, index: Index
) -> None:
    store = await Store.open(database_url, min_size=1, max_size=2)
    try:
        result = await bulk.import_lines(
            [herd_line(i) for i in range(120)], "hot", store, index, LOCAL, workers=1
        )
        assert result.imported == 120
        first = [
            ExecutionRow("hot", f"h{i:08d}", NOW, False, 1, "succeeded", 200, None, "k", NOW, NOW)
            for i in range(120)
        ]
        await store.write_stats(stats.fold(first))  # inserts the stats rows
        async with store.transaction() as conn:
            ids = [r["id"] for r in await conn.fetch(ONE_PER_PAGE.format(table="schedules"))]
            # Enough pages that a packed table would show it: every page held several rows.
            assert 10 <= len(ids) <= 40, len(ids)
            await conn.execute(
                QUERIES["write_checkpoints"],
                ["hot"] * len(ids),
                ids,
                [NOW] * len(ids),
                [NOW + 3_600_000] * len(ids),
                [1] * len(ids),
                [False] * len(ids),
                [1] * len(ids),
                [True] * len(ids),
            )
            assert await updates(conn, "schedules") == (len(ids), len(ids))
            checkpointed = await conn.fetch(
                "SELECT fires, last_fire_at FROM schedules WHERE id = ANY($1::text[])", ids
            )
            assert {
                (r["fires"], round(r["last_fire_at"].timestamp() * 1000)) for r in checkpointed
            } == {(1, NOW)}
        async with store.transaction() as conn:
            ids = [r["id"] for r in await conn.fetch(ONE_PER_PAGE.format(table="schedule_stats"))]
            assert len(ids) >= 2  # a full page at least (the last one may have room anyway)
            second = [
                ExecutionRow("hot", i, NOW + 1, False, 1, "succeeded", 200, None, "k", NOW, NOW)
                for i in ids
            ]
            await conn.execute(QUERIES["write_stats"], *stats_arguments(stats.fold(second)))
            assert await updates(conn, "schedule_stats") == (len(ids), len(ids))
    finally:
        await store.close()
