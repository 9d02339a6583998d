"""The sweeper against the real Redis and PostgreSQL: reclaim, rebuild, drift repair, retention."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
from redis.asyncio.lock import Lock

from services.sweeper.sweeper import Sweeper
from shared import bulk, codec, compact, db, netpolicy, timefmt, validation
from shared.config import SweeperSettings
from shared.index import Index, Upsert
from shared.store import Store
from tests.conftest import SHARDS

NOW = int(time.time() * 1000)

#: The schedules here call a loopback address.
LOCAL = validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK)


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    found = await Store.open(database_url)
    yield found
    await found.close()


@pytest.fixture
def sweeper(index: Index, store: Store, redis_prefix: str, database_url: str) -> Sweeper:
    settings = SweeperSettings(
        redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url, reclaim_batch=7
    )
    return Sweeper(settings, index, store, asyncio.Event())


async def load(store: Store, index: Index, *items: dict[str, object]) -> None:
    result = await bulk.import_lines(
        [codec.dumps(i) for i in items], "sw", store, index, LOCAL, workers=1
    )
    assert not result.refused, result.refused


def every(schedule_id: str, seconds: int, **extra: object) -> dict[str, object]:
    return {
        "id": schedule_id,
        "spec": {"kind": "interval", "every_s": seconds},
        "target": {"kind": "webhook", "url": "http://127.0.0.1:9/x"},
        **extra,
    }


async def members(index: Index) -> set[str]:
    found: set[str] = set()
    for shard in range(SHARDS):
        names = await index.client.hkeys(index.keys.sched(shard))
        found |= {m.decode() if isinstance(m, bytes) else m for m in names}
    return found


async def test_expired_leases_are_reclaimed_in_batches(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    await load(store, index, *(every(f"r{i}", 1) for i in range(30)))
    await asyncio.sleep(1.1)  # every one of them comes due
    results = await index.claim(range(SHARDS), 100, lease_ms=1)
    claimed = [c for r in results for c in r.claimed]
    assert claimed, "nothing was due"
    await asyncio.sleep(0.01)
    assert await sweeper.reclaim() == len(claimed)
    assert sum([await index.lease_count(s) for s in range(SHARDS)]) == 0
    # The reclaimed occurrences are due again, and the old tokens are stale.
    codes = await index.begin({claimed[0].shard: [(claimed[0].member, claimed[0].token, 1)]})
    assert codes == {claimed[0].shard: [0]}


async def test_one_sweeper_acts_per_step(sweeper: Sweeper, index: Index, store: Store) -> None:
    await load(store, index, every("locked", 1))
    await asyncio.sleep(1.1)
    await index.claim(range(SHARDS), 100, lease_ms=1)
    await asyncio.sleep(0.01)
    other = Lock(index.client, index.keys.sweep_lock, timeout=1)
    assert await other.acquire(token="another-sweeper")
    await sweeper.step()
    assert sum([await index.lease_count(s) for s in range(SHARDS)]) == 1
    await asyncio.sleep(1.1)  # the other sweeper died: its lock expires
    await sweeper.step()
    assert sum([await index.lease_count(s) for s in range(SHARDS)]) == 0


async def test_rebuild_restores_every_live_schedule_from_its_checkpoint(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    start = timefmt.format_ms(NOW + 3_600_000)
    await load(
        store,
        index,
        every("hourly", 3600, priority=5),
        every("later", 60, spec={"kind": "interval", "every_s": 60, "start_at": start}),
        every("paused", 60, paused=True),
        every("replayed", 1, misfire={"policy": "fire_all", "window_s": 3600, "limit": 1000}),
    )
    before = {m: await index.position(index.shard_of("sw", m[3:]), m) for m in await members(index)}
    # Pretend "replayed" last fired 5 minutes ago: the rebuild must replay since then.
    conn = await asyncpg.connect(sweeper.settings.database_url)
    try:
        await conn.execute(
            "UPDATE schedules SET last_fire_at = to_timestamp($1 / 1000.0), next_fire_at = "
            "to_timestamp($2 / 1000.0) WHERE id = 'replayed'",
            NOW - 300_000,
            NOW - 299_000,
        )
    finally:
        await conn.close()
    async for key in index.client.scan_iter(match=f"{index.keys.prefix}:*"):
        await index.client.delete(key)  # Redis lost everything, the epoch included

    await sweeper.check_epoch()
    assert sweeper.rebuilding is not None
    await sweeper.rebuilding
    assert await index.client.get(index.keys.epoch) is not None
    assert await members(index) == {"sw/hourly", "sw/later", "sw/paused", "sw/replayed"}
    assert await index.position(index.shard_of("sw", "hourly"), "sw/hourly") == before["sw/hourly"]
    later_due, _, _ = await index.position(index.shard_of("sw", "later"), "sw/later")
    assert later_due == NOW + 3_600_000
    paused_due, _, _ = await index.position(index.shard_of("sw", "paused"), "sw/paused")
    assert paused_due is None
    replay_due, _, _ = await index.position(index.shard_of("sw", "replayed"), "sw/replayed")
    assert replay_due == NOW - 299_000  # fire_all: the oldest missed time first


async def test_drift_repair_fixes_stale_missing_and_orphan_entries(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    await load(store, index, every("stale", 60), every("missing", 60), every("gone", 60))
    # "stale": PostgreSQL moved to version 2 (every 120 s) but the intake died before Redis.
    await load(store, index, every("stale", 120))
    shard = index.shard_of("sw", "stale")
    row = await store.get_schedule("sw", "stale")
    assert row is not None and row.version == 2
    old_plan = compact.with_version(compact.encode(compact.decode(row.compact)), 1)
    await index.upsert({shard: [Upsert("sw/stale", 1, old_plan, "reset", 5, "")]})
    await index.client.hset(
        index.keys.sched(shard),
        "sw/stale",
        compact.with_version((await index.stored_plan(shard, "sw/stale")) or b"", 1),
    )
    # "missing": in PostgreSQL, not in Redis. "gone": in Redis, deleted in PostgreSQL.
    await index.remove({index.shard_of("sw", "missing"): [("sw/missing", None)]})
    conn = await asyncpg.connect(sweeper.settings.database_url)
    try:
        await conn.execute(
            "UPDATE schedules SET state = 'deleted', version = version + 1 WHERE id = 'gone'"
        )
    finally:
        await conn.close()
    await index.upsert(
        {index.shard_of("sw", "orphan"): [Upsert("sw/orphan", 1, old_plan, "reset", NOW, "")]}
    )

    await sweeper.repair_drift()
    assert await members(index) == {"sw/stale", "sw/missing"}
    stored = await index.stored_plan(shard, "sw/stale")
    assert stored is not None and compact.version_of(stored) == 2
    stale_due, _, _ = await index.position(shard, "sw/stale")
    assert stale_due is not None and stale_due % 120_000 == 0


async def test_retention_drops_whole_partitions(sweeper: Sweeper, store: Store) -> None:
    today = dt.datetime.now(dt.UTC).date()
    async with store.pool.acquire() as conn:
        old = today - dt.timedelta(days=sweeper.settings.retention_days + 2)
        await db.ensure_partitions(conn, old, ahead_days=0, behind_days=0)
    await sweeper.keep_retention()
    async with store.pool.acquire() as conn:
        names = {
            r["relname"]
            for r in await conn.fetch(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'executions'::regclass"
            )
        }
    assert db.partition_name(old) not in names
    for ahead in range(sweeper.settings.partitions_ahead_days + 1):
        assert db.partition_name(today + dt.timedelta(days=ahead)) in names
