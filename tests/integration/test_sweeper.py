"""The sweeper against the real Redis and PostgreSQL: reclaim, rebuild, drift repair, retention."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
from typing import Any

import asyncpg
import pytest
from redis.asyncio.lock import Lock

from services.sweeper import rebuild as rebuild_module
from services.sweeper.sweeper import Sweeper
from shared.contract import codec, keys, timefmt, validation
from shared.contract.entries import Upsert
from shared.contract.rows import Checkpoint, PendingRun
from shared.policy import netpolicy
from shared.postgres import bulk, db
from shared.postgres.store import Store
from shared.redis.index import Index
from shared.rules import compact
from shared.rules.plan import IntervalRule
from shared.runtime.config import SweeperSettings
from tests.conftest import SHARDS

NOW = int(time.time() * 1000)

#: The schedules here call a loopback address.
LOCAL = validation.TargetPolicy(allowed_networks=netpolicy.LOOPBACK)


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
    _, codes = await index.begin({claimed[0].shard: [(claimed[0].member, claimed[0].token, 1)]})
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
    # This test's own clock: the module's NOW may be minutes old in a long run, and the
    # replay below is bounded by fire_all's limit of 1000 one-second occurrences.
    now = int(time.time() * 1000)
    start = timefmt.format_ms(NOW + 3_600_000)
    anchor = timefmt.format_ms(now - 1_800_000)
    await load(
        store,
        index,
        # Anchored half an hour back, not on the epoch's grid: a whole hour passing before
        # the rebuild would make its next fire a catch-up, not the one stored.
        every(
            "hourly",
            3600,
            priority=5,
            spec={"kind": "interval", "every_s": 3600, "start_at": anchor},
        ),
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
            now - 300_000,
            now - 299_000,
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
    assert replay_due == now - 299_000  # fire_all: the oldest missed time first


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
    # (Its keys vanish without a tombstone: nothing deleted or finished it.)
    missing_shard = index.shard_of("sw", "missing")
    await index.client.hdel(index.keys.sched(missing_shard), "sw/missing")
    await index.client.zrem(index.keys.due(missing_shard), "sw/missing")
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


async def test_an_index_restored_from_an_older_snapshot_is_rebuilt(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    await load(store, index, every("kept", 60), every("deleted-later", 60))
    await sweeper.check_epoch()
    assert sweeper.rebuilding is not None
    await sweeper.rebuilding
    snapshot_generation = await index.client.get(index.keys.epoch)
    for _ in range(3):  # sweeps move the generation forward, in Redis and PostgreSQL
        await sweeper.check_epoch()
    assert await store.index_generation() == int(snapshot_generation or 0) + 3
    # PostgreSQL moves on (the schedule is deleted) while Redis is restored from the snapshot
    # taken before: it still holds the deleted schedule and the old generation.
    conn = await asyncpg.connect(sweeper.settings.database_url)
    try:
        await conn.execute(
            "UPDATE schedules SET state = 'deleted', version = version + 1 "
            "WHERE id = 'deleted-later'"
        )
    finally:
        await conn.close()
    await index.client.set(index.keys.epoch, snapshot_generation or b"")
    assert "sw/deleted-later" in await members(index)

    await sweeper.check_epoch()
    assert sweeper.rebuilding is not None
    await sweeper.rebuilding
    assert await members(index) == {"sw/kept"}
    assert int(await index.client.get(index.keys.epoch) or 0) > await store.index_generation() - 1


async def test_a_delete_wins_over_a_rebuild_that_read_the_schedule_before(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    await load(store, index, every("raced", 60))
    [row] = [r async for chunk in store.live_schedules(10) for r in chunk]
    # The delete lands (PostgreSQL, then the index) after the rebuild read the row.
    shard = index.shard_of("sw", "raced")
    assert await index.remove({shard: [("sw/raced", row.version + 1)]}) == {shard: [1]}
    await sweeper._write_entries([row], await sweeper.redis_now_ms())
    assert await members(index) == set()
    assert await index.position(shard, "sw/raced") == (None, None, None)


async def test_a_checkpoint_from_before_a_reset_is_refused(index: Index, store: Store) -> None:
    await load(store, index, every("reset", 60))
    first = await store.get_schedule("sw", "reset")
    assert first is not None
    # The rule changes: a new rotation (version 2, no fires yet).
    await load(store, index, every("reset", 3600))
    # A late audit batch from an occurrence of the old rotation.
    await store.write_checkpoints([Checkpoint("sw", "reset", NOW, NOW + 60_000, 1, version=1)])
    row = await store.get_schedule("sw", "reset")
    assert row is not None and row.version == 2
    assert (row.fires, row.last_fire_ms) == (0, None)
    assert row.next_fire_ms is not None and row.next_fire_ms % 3_600_000 == 0
    # The new rotation's own checkpoint lands.
    await store.write_checkpoints([Checkpoint("sw", "reset", NOW, NOW + 3_600_000, 1, version=2)])
    row = await store.get_schedule("sw", "reset")
    assert row is not None and (row.fires, row.last_fire_ms) == (1, NOW)


async def pend(store: Store, schedule_id: str, at: int, *, age_s: int = 0) -> str:
    """A trigger the intake accepted ``age_s`` ago; returns its index member."""
    async with store.transaction() as conn:
        assert await store.add_pending_run(conn, PendingRun("sw", schedule_id, "trigger", at))
        await conn.execute(
            "UPDATE pending_runs SET created_at = now() - make_interval(secs => $1) "
            "WHERE id = $2 AND nominal_ms = $3",
            age_s,
            schedule_id,
            at,
        )
    return keys.trigger_member("sw", schedule_id, at)


async def due_at(index: Index, member: str) -> int | None:
    namespace, schedule_id, _ = keys.split_member(member)
    due, _, _ = await index.position(index.shard_of(namespace, schedule_id), member)
    return due


async def test_rebuild_restores_the_pending_triggers_of_schedules_not_deleted(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    await load(
        store,
        index,
        every("active", 3600),
        every("paused", 3600, paused=True),
        every("done", 3600),
        every("deleted", 3600),
    )
    triggers = {name: await pend(store, name, NOW - 5000) for name in ("active", "paused", "done")}
    triggers["second"] = await pend(store, "active", NOW - 4000)
    deleted = await pend(store, "deleted", NOW - 5000)
    conn = await asyncpg.connect(sweeper.settings.database_url)
    try:
        await conn.execute("UPDATE schedules SET state = 'completed' WHERE id = 'done'")
        await conn.execute("UPDATE schedules SET state = 'deleted' WHERE id = 'deleted'")
    finally:
        await conn.close()
    async for key in index.client.scan_iter(match=f"{index.keys.prefix}:*"):
        await index.client.delete(key)  # Redis lost everything, the epoch included
    # An intake re-added one of them meanwhile, at its own time: it is not moved (NX).
    await index.add_trigger(index.shard_of("sw", "active"), triggers["second"], NOW - 3999)

    await sweeper.check_epoch()
    assert sweeper.rebuilding is not None
    await sweeper.rebuilding
    assert await index.client.get(index.keys.epoch) is not None
    assert await due_at(index, triggers["active"]) == NOW - 5000
    assert await due_at(index, triggers["paused"]) == NOW - 5000
    assert await due_at(index, triggers["done"]) == NOW - 5000
    assert await due_at(index, triggers["second"]) == NOW - 3999
    assert await due_at(index, deleted) is None
    # Each can be claimed: its schedule is stored (a completed one out of rotation).
    claimed = [c for r in await index.claim(range(SHARDS), 100, lease_ms=60_000) for c in r.claimed]
    assert {c.member for c in claimed} >= {triggers[n] for n in ("active", "paused", "done")}
    assert await due_at(index, "sw/done") is None


async def test_drift_repair_re_adds_an_old_pending_trigger_the_index_lost(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    await load(store, index, every("lost", 3600), every("young", 3600), every("flying", 3600))
    lost = await pend(store, "lost", NOW - 120_000, age_s=120)  # intake died before Redis
    young = await pend(store, "young", NOW - 1000, age_s=1)  # intake may be writing it now
    flying = await pend(store, "flying", NOW - 120_000, age_s=120)
    await index.add_trigger(index.shard_of("sw", "flying"), flying, NOW - 120_000)
    claimed = await index.claim([index.shard_of("sw", "flying")], 100, lease_ms=600_000)
    assert flying in {c.member for r in claimed for c in r.claimed}  # in flight now

    repair = sweeper.pending_repair
    now = int(time.time() * 1000)  # ages count from PostgreSQL's clock, not the module's NOW
    # Seen missing once is not enough (a completion may be on its way to PostgreSQL).
    assert await repair.check(now) == 0
    assert await due_at(index, lost) is None
    assert await repair.check(now) == 1
    assert await due_at(index, lost) == NOW - 120_000
    assert await due_at(index, young) is None
    assert await due_at(index, flying) is None  # in flight: never handed out twice
    assert await repair.check(now) == 0


async def test_the_full_drift_comparison_is_spread_over_checks_in_slices(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    await load(store, index, *(every(f"m{i:02d}", 60) for i in range(10)))
    for i in range(10):  # all ten in PostgreSQL, none in Redis (an intake that died)
        shard = index.shard_of("sw", f"m{i:02d}")
        await index.client.hdel(index.keys.sched(shard), f"sw/m{i:02d}")
        await index.client.zrem(index.keys.due(shard), f"sw/m{i:02d}")
    sweeper.slice_min = 4  # the slice (10 entries, 30 checks per full interval): 4 rows

    assert await sweeper.drift_slice() == 4
    # Key order: the first slice compared m00..m03 and nothing after them.
    assert await members(index) == {f"sw/m{i:02d}" for i in range(4)}
    assert await sweeper.drift_slice() == 4
    assert await sweeper.drift_slice() == 2  # the end of the table: the pass starts over
    assert await members(index) == {f"sw/m{i:02d}" for i in range(10)}

    # The next pass starts from the first key again and still finds what it must repair.
    shard = index.shard_of("sw", "m01")
    await index.client.hdel(index.keys.sched(shard), "sw/m01")
    await index.client.zrem(index.keys.due(shard), "sw/m01")
    assert await sweeper.drift_slice() == 1
    assert "sw/m01" in await members(index)


async def test_index_entries_without_a_row_are_removed_slice_by_slice(
    sweeper: Sweeper, index: Index, store: Store
) -> None:
    await load(store, index, every("kept", 60))
    row = await store.get_schedule("sw", "kept")
    assert row is not None
    for i in range(6):
        member = f"sw/orphan{i}"
        await index.upsert(
            {index.shard_of("sw", f"orphan{i}"): [Upsert(member, 1, row.compact, "reset", NOW, "")]}
        )
    sweeper.slice_min = 1
    for _ in range(SHARDS + 1):  # at most one shard's entries per slice here: a pass or more
        await sweeper.drift_slice()
    assert await members(index) == {"sw/kept"}


async def test_a_slice_brings_an_entry_behind_its_row_up_to_the_row(
    sweeper: Sweeper, index: Index, store: Store, database_url: str
) -> None:
    await load(store, index, every("ahead", 60), every("level", 60))
    # PostgreSQL moved on to version 4 (every minute -> every 2 minutes); the index's write of
    # it never landed. The other schedule is level with its row and must be left as it is.
    conn = await asyncpg.connect(database_url)
    try:
        row = await store.get_schedule("sw", "ahead")
        assert row is not None
        plan = compact.decode(row.compact)
        changed = compact.encode(dataclasses.replace(plan, rule=IntervalRule(120_000)))
        await conn.execute(
            "UPDATE schedules SET version = 4, compact = $1 WHERE id = 'ahead'",
            compact.with_version(changed, 4),
        )
    finally:
        await conn.close()
    level_shard = index.shard_of("sw", "level")
    level_before = await index.stored_plan(level_shard, "sw/level")

    assert await sweeper.drift_slice() == 1
    stored = await index.stored_plan(index.shard_of("sw", "ahead"), "sw/ahead")
    assert stored is not None and compact.version_of(stored) == 4
    assert compact.decode(stored).rule == IntervalRule(120_000)
    assert await index.stored_plan(level_shard, "sw/level") == level_before


async def test_a_rebuild_across_which_redis_lost_data_again_is_followed_by_another(
    index: Index, store: Store, redis_prefix: str, database_url: str
) -> None:
    settings = SweeperSettings(
        redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url, rebuild_batch=1
    )
    rebuilder = Sweeper(settings, index, store, asyncio.Event())
    await load(store, index, every("first", 60, priority=5), every("second", 60))

    async def lose_everything() -> None:
        async for key in index.client.scan_iter(match=f"{index.keys.prefix}:*"):
            await index.client.delete(key)

    await lose_everything()
    real = rebuilder._write_entries
    pages = 0

    async def lose_again_after_the_first_page(rows: Any, now: int) -> int:
        nonlocal pages
        pages += 1
        written = await real(rows, now)
        if pages == 1:
            await lose_everything()  # Redis restarted empty between two pages
        return written

    rebuilder._write_entries = lose_again_after_the_first_page  # type: ignore[method-assign]
    await rebuilder.check_epoch()
    assert rebuilder.rebuilding is not None
    await rebuilder.rebuilding
    assert pages >= 2
    rebuilder._write_entries = real  # type: ignore[method-assign]
    # The next check must not take the index for complete: "first" was lost with it.
    await rebuilder.check_epoch()
    if rebuilder.rebuilding is not None:
        await rebuilder.rebuilding
    assert await members(index) == {"sw/first", "sw/second"}
    assert await index.client.get(index.keys.epoch) is not None


async def test_a_rebuild_that_lost_its_lock_stops_and_sets_no_epoch(
    index: Index, store: Store, redis_prefix: str, database_url: str, monkeypatch: Any
) -> None:
    # Renewed often here, so that the loss is seen within the test.
    monkeypatch.setattr(rebuild_module, "REBUILD_LOCK_RENEW_S", 0.05)
    settings = SweeperSettings(
        redis_prefix=redis_prefix, shards=SHARDS, database_url=database_url, rebuild_batch=1
    )
    rebuilder = Sweeper(settings, index, store, asyncio.Event())
    await load(store, index, *(every(f"p{i}", 60, priority=i) for i in range(6)))
    await index.client.delete(index.keys.epoch)
    real = rebuilder._write_entries
    pages = 0

    async def lose_the_lock_at_the_first_page(rows: Any, now: int) -> int:
        nonlocal pages
        pages += 1
        if pages == 1:
            # The lock ran out (Redis was away past its time to live) and another sweeper
            # took it to rebuild: this one must not go on, nor set the epoch at its end.
            await index.client.set(index.keys.rebuild_lock, "another-sweeper")
            await asyncio.sleep(0.5)
        return await real(rows, now)

    rebuilder._write_entries = lose_the_lock_at_the_first_page  # type: ignore[method-assign]
    await rebuilder.check_epoch()
    assert rebuilder.rebuilding is not None
    await asyncio.wait_for(rebuilder.rebuilding, 30)
    assert pages < 6, "the rebuild went on without its lock"
    assert await index.client.get(index.keys.epoch) is None
    assert await index.client.get(index.keys.rebuild_lock) == b"another-sweeper"


async def test_drift_repair_stops_a_rotation_whose_row_completed_without_its_index_write(
    sweeper: Sweeper, index: Index, store: Store, database_url: str
) -> None:
    await load(store, index, every("recent", 60), every("long-ago", 60))
    # An upsert ended each schedule (its window closed: PostgreSQL says completed at version 2,
    # a new rotation) and the intake died before its index write (a removal). One change is
    # recent (the incremental check sees it); the other is older than any incremental window
    # (the sweeper was down meanwhile): only the full comparison can find it.
    conn = await asyncpg.connect(database_url)
    try:
        for name, age in (("recent", dt.timedelta(0)), ("long-ago", dt.timedelta(hours=1))):
            row = await store.get_schedule("sw", name)
            assert row is not None
            assert await due_at(index, f"sw/{name}") is not None
            await conn.execute(
                "UPDATE schedules SET state = 'completed', version = 2, rotation_version = 2, "
                "compact = $1, next_fire_at = NULL, updated_at = now() - $2::interval "
                "WHERE id = $3",
                compact.with_version(row.compact, 2),
                age,
                name,
            )
    finally:
        await conn.close()

    await sweeper.repair_drift()  # the recent window, and a slice of the full comparison
    assert await due_at(index, "sw/recent") is None
    for _ in range(SHARDS + 1):  # a full pass, or more
        await sweeper.drift_slice()
    # The old rotations must not go on firing schedules PostgreSQL says are over.
    assert await due_at(index, "sw/long-ago") is None
    assert await members(index) == set()
