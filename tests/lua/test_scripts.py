"""Each Lua script against the real Redis: results, fencing, batch limits, concurrency."""

from __future__ import annotations

import asyncio
import re

import pytest
import redis.asyncio as aioredis

from shared.contract import keys
from shared.contract.entries import Completion, Upsert, occ_state
from shared.contract.errors import StaleWriteError
from shared.redis import lua
from shared.redis.index import Index
from shared.rules import compact
from shared.rules.plan import IntervalRule, Plan, WebhookPlan
from tests.support import services

NOW = 1_800_000_000_000
LEASE_MS = 30_000


def plan(version: int = 1) -> bytes:
    return compact.encode(
        Plan(version=version, rule=IntervalRule(60_000), target=WebhookPlan("http://sink/x"))
    )


async def add(
    index: Index,
    shard: int,
    member: str,
    fire_ms: int,
    version: int = 1,
    mode: str = "keep",
    next_occ: str = "",
) -> int:
    result = await index.upsert(
        {shard: [Upsert(member, version, plan(version), mode, fire_ms, next_occ)]}  # type: ignore[arg-type]
    )
    return result[shard][0]


async def snapshot(index: Index, shard: int) -> dict[str, object]:
    client = index.client
    return {
        "due": await client.zrange(index.keys.due(shard), 0, -1, withscores=True),
        "lease": await client.zrange(index.keys.lease(shard), 0, -1, withscores=True),
        "occ": await client.hgetall(index.keys.occ(shard)),
        "sched": await client.hgetall(index.keys.sched(shard)),
    }


def test_every_script_has_a_header_naming_keys_argv_and_returns() -> None:
    for script in lua.scripts().values():
        header = script.source.split("]]", 1)[0]
        assert header.startswith("--[["), script.name
        keys_declared = re.findall(r"KEYS\[(\d)\]", header)
        assert keys_declared == [str(i) for i in range(1, len(keys_declared) + 1)], script.name
        assert "ARGV" in header and "Returns" in header, script.name
        used = {int(n) for n in re.findall(r"KEYS\[(\d)\]", script.source.split("]]", 1)[1])}
        assert used == set(range(1, script.key_count + 1)), script.name


async def test_claim_takes_only_what_is_due_and_leases_it(index: Index) -> None:
    await add(index, 0, "ns/due-1", NOW - 2000)
    await add(index, 0, "ns/due-2", NOW - 1000)
    await add(index, 0, "ns/later", NOW + 1)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    assert [c.member for c in result.claimed] == ["ns/due-1", "ns/due-2"]
    assert result.next_due_ms == NOW + 1
    assert result.now_ms == NOW
    first = result.claimed[0]
    assert (first.fire_ms, first.nominal_ms, first.attempt, first.fires) == (
        NOW - 2000,
        NOW - 2000,
        1,
        0,
    )
    assert compact.decode(first.plan).version == 1
    state = await snapshot(index, 0)
    assert state["due"] == [(b"ns/later", float(NOW + 1))]
    assert state["lease"] == [
        (b"ns/due-1", float(NOW + LEASE_MS)),
        (b"ns/due-2", float(NOW + LEASE_MS)),
    ]
    assert result.claimed[0].token != result.claimed[1].token


async def test_claim_respects_its_batch_limit_and_reports_more_due(index: Index) -> None:
    for i in range(25):
        await add(index, 1, f"ns/s{i:02d}", NOW - 100 + i)
    [first] = await index.claim([1], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    assert len(first.claimed) == 10
    assert first.next_due_ms is not None and first.next_due_ms <= NOW
    [second] = await index.claim([1], limit=100, lease_ms=LEASE_MS, now_ms=NOW)
    assert len(second.claimed) == 15
    assert second.next_due_ms is None


async def test_claim_uses_the_server_clock_when_none_is_given(index: Index) -> None:
    await add(index, 0, "ns/past", 1000)
    await add(index, 0, "ns/far-future", 4_000_000_000_000)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS)
    assert [c.member for c in result.claimed] == ["ns/past"]
    server_seconds, _ = await index.client.time()
    assert abs(result.now_ms - server_seconds * 1000) < 2000


async def test_claim_drops_orphans_whose_schedule_is_gone(index: Index) -> None:
    await index.client.zadd(index.keys.due(2), {"ns/gone#123": NOW - 5, "ns/gone": NOW - 4})
    [result] = await index.claim([2], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    assert result.claimed == [] and result.orphans == 2
    assert await index.client.zcard(index.keys.due(2)) == 0


async def test_claim_keeps_stored_occurrence_state(index: Index) -> None:
    await add(index, 0, "ns/jittered", NOW - 10, next_occ=occ_state(NOW - 500, 1, "", 7))
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    [item] = result.claimed
    assert (item.fire_ms, item.nominal_ms, item.attempt, item.fires) == (NOW - 10, NOW - 500, 1, 7)


async def test_begin_holds_current_leases_and_reports_stale_tokens(index: Index) -> None:
    await add(index, 0, "ns/a", NOW - 1)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    now, codes = await index.begin(
        {0: [("ns/a", token, 90_000), ("ns/a", token + 99, 90_000)]}, now_ms=NOW + 5
    )
    assert (now, codes) == (NOW + 5, {0: [1, 0]})
    assert await index.client.zscore(index.keys.lease(0), "ns/a") == NOW + 5 + 90_000
    # A shorter hold never shortens the lease.
    await index.begin({0: [("ns/a", token, 10)]}, now_ms=NOW + 6)
    assert await index.client.zscore(index.keys.lease(0), "ns/a") == NOW + 5 + 90_000


async def test_a_begun_delivery_is_flagged_so_whoever_takes_it_over_delivers_it_again(
    index: Index,
) -> None:
    await add(index, 0, "ns/a", NOW - 1, next_occ=occ_state(NOW - 1, 1, "", 3))
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    # Holding a lease while waiting for a slot begins nothing.
    assert (await index.begin({0: [("ns/a", token, 9)]}, now_ms=NOW, delivering=False))[1] == {
        0: [1]
    }
    assert (await index.begin({0: [("ns/a", token, 9)]}, now_ms=NOW))[1] == {0: [1]}
    # A second copy of the message (the broker redelivered it) is told the delivery began.
    assert (await index.begin({0: [("ns/a", token, 9)]}, now_ms=NOW + 1))[1] == {0: [2]}
    # So is the copy the sweeper hands out once the lease runs out: a catch-up, not judged.
    await index.reclaim([0], 10, now_ms=NOW + LEASE_MS + 60_000)
    [again] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW + LEASE_MS + 60_001)
    [item] = again.claimed
    assert (item.nominal_ms, item.fires, item.catch_up) == (NOW - 1, 3, True)


async def test_a_missed_occurrence_is_not_flagged_until_its_policy_delivers_it(
    index: Index,
) -> None:
    await add(index, 0, "ns/m", NOW - 1)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    # Past its cutoff (due time plus grace): judged, not flagged.
    assert (await index.begin({0: [("ns/m", token, 9, NOW)]}, now_ms=NOW + 1))[1] == {0: [3]}
    assert (await index.begin({0: [("ns/m", token, 9, NOW)]}, now_ms=NOW + 2))[1] == {0: [3]}
    # Its policy delivers it all the same (a catch-up): flagged by a call without a cutoff.
    assert (await index.begin({0: [("ns/m", token, 9, None)]}, now_ms=NOW + 3))[1] == {0: [1]}
    assert (await index.begin({0: [("ns/m", token, 9, NOW)]}, now_ms=NOW + 4))[1] == {0: [2]}
    # On time (at its cutoff) it is flagged at once.
    await add(index, 1, "ns/t", NOW - 1)
    [other] = await index.claim([1], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    on_time = other.claimed[0].token
    assert (await index.begin({1: [("ns/t", on_time, 9, NOW)]}, now_ms=NOW))[1] == {1: [1]}
    assert (await index.begin({1: [("ns/t", on_time, 9, NOW)]}, now_ms=NOW + 9))[1] == {1: [2]}


async def test_complete_reschedules_once_and_a_stale_token_changes_nothing(index: Index) -> None:
    await add(index, 3, "ns/c", NOW - 1)
    [result] = await index.claim([3], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    stale = await index.complete({3: [Completion("ns/c", token + 1, NOW + 60_000)]})
    assert stale == {3: [0]}
    before = await snapshot(index, 3)
    assert before["due"] == [] and len(before["lease"]) == 1  # type: ignore[arg-type]
    done = await index.complete({3: [Completion("ns/c", token, NOW + 60_000)]})
    assert done == {3: [1]}
    after = await snapshot(index, 3)
    assert after["due"] == [(b"ns/c", float(NOW + 60_000))]
    assert after["lease"] == [] and after["occ"] == {}
    # The same completion again (a redelivered message) is stale: nothing moves.
    assert await index.complete({3: [Completion("ns/c", token, NOW + 120_000)]}) == {3: [0]}
    assert await snapshot(index, 3) == after


async def test_complete_can_finish_a_schedule_and_store_the_next_state(index: Index) -> None:
    await add(index, 0, "ns/last", NOW - 1)
    await add(index, 0, "ns/next", NOW - 1)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    tokens = {c.member: c.token for c in result.claimed}
    codes = await index.complete(
        {
            0: [
                Completion("ns/last", tokens["ns/last"], None, finish=True),
                Completion("ns/next", tokens["ns/next"], NOW + 7, occ_state(NOW + 5, 1, "", 3)),
            ]
        }
    )
    assert codes == {0: [1, 1]}
    state = await snapshot(index, 0)
    assert state["sched"].keys() == {b"ns/next"}  # type: ignore[attr-defined]
    assert state["due"] == [(b"ns/next", float(NOW + 7))]
    assert state["occ"] == {b"ns/next": f"{NOW + 5}|1||3".encode()}


async def test_retry_bumps_the_attempt_and_makes_the_old_token_stale(index: Index) -> None:
    await add(index, 0, "ns/r", NOW - 1)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    assert await index.retry({0: [("ns/r", token + 5, 1000)]}, now_ms=NOW) == {0: [0]}
    assert await index.retry({0: [("ns/r", token, 1500)]}, now_ms=NOW) == {0: [1]}
    state = await snapshot(index, 0)
    assert state["due"] == [(b"ns/r", float(NOW + 1500))]
    assert state["lease"] == []
    assert await index.complete({0: [Completion("ns/r", token, NOW + 60_000)]}) == {0: [0]}
    [again] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW + 1500)
    [item] = again.claimed
    assert (item.attempt, item.nominal_ms) == (2, NOW - 1)
    assert item.token != token


async def test_reclaim_returns_expired_leases_with_a_new_token(index: Index) -> None:
    await add(index, 1, "ns/expired", NOW - 1)
    await add(index, 1, "ns/held", NOW - 1)
    [result] = await index.claim([1], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    tokens = {c.member: c.token for c in result.claimed}
    await index.begin({1: [("ns/held", tokens["ns/held"], 120_000)]}, now_ms=NOW)
    counts = await index.reclaim([1], limit=100, now_ms=NOW + LEASE_MS + 1)
    assert counts == {1: (1, 0)}
    state = await snapshot(index, 1)
    assert state["due"] == [(b"ns/expired", float(NOW + LEASE_MS + 1))]
    # The message that carried the reclaimed occurrence is stale now.
    assert (await index.begin({1: [("ns/expired", tokens["ns/expired"], 1000)]}))[1] == {1: [0]}
    [again] = await index.claim([1], limit=10, lease_ms=LEASE_MS, now_ms=NOW + LEASE_MS + 2)
    assert [(c.member, c.attempt) for c in again.claimed] == [("ns/expired", 1)]
    assert again.claimed[0].token not in tokens.values()


async def test_reclaim_drops_leases_of_removed_schedules(index: Index) -> None:
    await add(index, 0, "ns/x", NOW - 1)
    await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    await index.client.hdel(index.keys.sched(0), "ns/x")
    assert await index.reclaim([0], limit=10, now_ms=NOW + LEASE_MS + 1) == {0: (0, 1)}
    assert (await snapshot(index, 0))["due"] == []


async def test_upsert_modes(index: Index) -> None:
    await add(index, 0, "ns/u", NOW + 100)
    # keep: the running rotation stays where it is.
    assert await add(index, 0, "ns/u", NOW + 999, version=2, mode="keep") == 1
    assert await index.client.zscore(index.keys.due(0), "ns/u") == NOW + 100
    # reset: the rotation restarts at the new time.
    assert await add(index, 0, "ns/u", NOW + 999, version=3, mode="reset") == 1
    assert await index.client.zscore(index.keys.due(0), "ns/u") == NOW + 999
    # park: out of rotation, the schedule stays stored (a trigger can still find it).
    assert await add(index, 0, "ns/u", NOW + 5, version=4, mode="park") == 1
    state = await snapshot(index, 0)
    assert state["due"] == [] and b"ns/u" in state["sched"]  # type: ignore[operator]


async def test_upsert_reset_revokes_the_occurrence_in_flight(index: Index) -> None:
    await add(index, 0, "ns/f", NOW - 1)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    await add(index, 0, "ns/f", NOW + 500, version=2, mode="reset")
    assert await index.complete({0: [Completion("ns/f", token, NOW + 60_000)]}) == {0: [0]}
    state = await snapshot(index, 0)
    assert state["due"] == [(b"ns/f", float(NOW + 500))] and state["lease"] == []


async def test_a_stale_upsert_or_remove_changes_nothing(index: Index) -> None:
    await add(index, 0, "ns/v", NOW + 100, version=5)
    before = await snapshot(index, 0)
    assert await add(index, 0, "ns/v", NOW + 1, version=4, mode="reset") == -1
    assert await index.remove({0: [("ns/v", 4)]}) == {0: [-1]}
    assert await snapshot(index, 0) == before
    with pytest.raises(StaleWriteError, match="newer version"):
        lua.raise_for_code("upsert", -1)
    assert await index.remove({0: [("ns/v", 5)]}) == {0: [1]}
    assert await index.remove({0: [("ns/v", None)]}) == {0: [0]}
    assert await snapshot(index, 0) == {"due": [], "lease": [], "occ": {}, "sched": {}}
    # The removal left a tombstone of version 5: a write of version 5 (a rebuild that read
    # the schedule before its delete) cannot bring it back; version 6 can.
    assert await add(index, 0, "ns/v", NOW + 1, version=5, mode="keep") == -1
    assert await index.client.zscore(index.keys.due(0), "ns/v") is None
    assert await add(index, 0, "ns/v", NOW + 1, version=6, mode="keep") == 1
    assert await index.client.hget(index.keys.gone(0), "ns/v") is None


async def test_noscript_after_a_script_flush_is_recovered(index: Index) -> None:
    await add(index, 0, "ns/n", NOW - 1)
    await index.client.script_flush()
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    assert len(result.claimed) == 1
    await index.client.script_flush()
    results = await index.claim([0, 1, 2], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    assert [r.claimed for r in results] == [[], [], []]


async def test_concurrent_claimers_never_share_an_occurrence(
    endpoints: services.Endpoints, redis_prefix: str, index: Index
) -> None:
    total = 5000
    pipe = index.client.pipeline(transaction=False)
    for i in range(total):
        shard = i % 4
        pipe.hset(index.keys.sched(shard), f"ns/c{i}", plan())
        pipe.zadd(index.keys.due(shard), {f"ns/c{i}": NOW - i})
    await pipe.execute()

    async def claimer() -> list[tuple[str, int, int]]:
        client = aioredis.Redis.from_url(endpoints.redis_url)
        mine = Index(client, keys.RedisKeys(redis_prefix), 4)
        got: list[tuple[str, int, int]] = []
        try:
            while True:
                results = await mine.claim(range(4), limit=37, lease_ms=LEASE_MS, now_ms=NOW)
                batch = [(c.member, c.shard, c.token) for r in results for c in r.claimed]
                if not batch:
                    return got
                got += batch
        finally:
            await client.aclose()

    claims = await asyncio.gather(*(claimer() for _ in range(12)))
    members = [m for batch in claims for m, _, _ in batch]
    assert len(members) == total
    assert len(set(members)) == total
    # Fencing tokens are unique within a shard.
    assert len({(shard, token) for batch in claims for _, shard, token in batch}) == total
    assert sum(1 for batch in claims if batch) > 1, "expected the claimers to interleave"


async def test_release_hands_back_an_unpublished_claim(index: Index) -> None:
    await add(index, 0, "ns/p", NOW - 1)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    assert await index.release({0: [("ns/p", token + 1)]}, now_ms=NOW) == {0: [0]}
    assert await index.release({0: [("ns/p", token)]}, now_ms=NOW + 3) == {0: [1]}
    state = await snapshot(index, 0)
    assert state["due"] == [(b"ns/p", float(NOW + 3))] and state["lease"] == []
    [again] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW + 3)
    assert [(c.attempt, c.nominal_ms) for c in again.claimed] == [(1, NOW - 1)]


async def test_failures_counts_consecutive_dead_and_clears(index: Index) -> None:
    counts = await index.count_failures({0: [("ns/a", "dead"), ("ns/a", "dead"), ("ns/b", "dead")]})
    assert counts == {0: [1, 2, 1]}
    counts = await index.count_failures(
        {0: [("ns/a", "clear"), ("ns/a", "dead")], 1: [("ns/c", "dead")]}
    )
    assert counts == {0: [0, 1], 1: [1]}
    assert await index.client.hgetall(index.keys.fails(0)) == {b"ns/a": b"1", b"ns/b": b"1"}


async def test_claim_checks_what_it_reads_before_writing(index: Index) -> None:
    await add(index, 0, "ns/broken", NOW - 5, next_occ="garbage")
    await add(index, 0, "ns/fine", NOW - 4)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    assert [c.member for c in result.claimed] == ["ns/fine"]
    assert result.corrupt == 1
    # Not lost: still due, a minute on, so it does not block the head of the shard.
    assert await index.client.zscore(index.keys.due(0), "ns/broken") == NOW + 60_000
    assert await index.client.hget(index.keys.occ(0), "ns/broken") == b"garbage"


async def test_tokens_never_repeat_after_redis_loses_its_counter(index: Index) -> None:
    await add(index, 0, "ns/t", NOW - 1)
    [first] = await index.claim([0], limit=1, lease_ms=LEASE_MS, now_ms=NOW)
    old = first.claimed[0].token
    assert old > NOW * 1000  # at least the clock in microseconds
    # Redis lost its data (the counter included): the index is written again.
    await index.client.delete(
        index.keys.seq(0),
        index.keys.occ(0),
        index.keys.lease(0),
        index.keys.due(0),
        index.keys.sched(0),
    )
    await add(index, 0, "ns/t", NOW)
    [again] = await index.claim([0], limit=1, lease_ms=LEASE_MS, now_ms=NOW + 1)
    assert again.claimed[0].token > old
    # The message minted before the loss does not pass the fence.
    _, codes = await index.begin({0: [("ns/t", old, 1000)]}, now_ms=NOW + 2)
    assert codes == {0: [0]}


async def test_a_finished_schedule_leaves_a_tombstone_no_repair_can_undo(index: Index) -> None:
    await add(index, 0, "ns/once", NOW - 1, version=3)
    [result] = await index.claim([0], limit=1, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    done = await index.complete({0: [Completion("ns/once", token, None, "", finish=True)]}, NOW)
    assert done == {0: [1]}
    assert await index.client.hget(index.keys.gone(0), "ns/once") == f"3|{NOW}|f".encode()
    # A drift repair or rebuild that read PostgreSQL before the checkpoint landed there.
    assert await add(index, 0, "ns/once", NOW - 1, version=3, mode="keep") == -1
    assert await snapshot(index, 0) == {"due": [], "lease": [], "occ": {}, "sched": {}}
    # A new version (the user changed the schedule) is not a repair: it is written.
    assert await add(index, 0, "ns/once", NOW + 10, version=4, mode="reset") == 1


async def test_the_catch_up_flag_survives_retry_reclaim_and_claim(index: Index) -> None:
    state = occ_state(NOW - 500, 1, "", 2, "c")
    await add(index, 0, "ns/late", NOW - 400, next_occ=state)
    [result] = await index.claim([0], limit=1, lease_ms=LEASE_MS, now_ms=NOW)
    [item] = result.claimed
    assert (item.nominal_ms, item.fires, item.catch_up) == (NOW - 500, 2, True)
    await index.retry({0: [("ns/late", item.token, 0)]}, now_ms=NOW)
    [retried] = (await index.claim([0], limit=1, lease_ms=1, now_ms=NOW + 1))[0].claimed
    assert retried.catch_up and retried.attempt == 2
    assert await index.reclaim([0], limit=10, now_ms=NOW + 10) == {0: (1, 0)}
    [reclaimed] = (await index.claim([0], limit=1, lease_ms=1, now_ms=NOW + 11))[0].claimed
    assert reclaimed.catch_up and reclaimed.fires == 2


def json_plan(version: int) -> bytes:
    """A value as versions before the binary form stored it."""
    return compact.encode_json(compact.decode(plan(version)))


@pytest.mark.parametrize("stored_as", ["binary", "json"])
@pytest.mark.parametrize("version", [7, 123, 2**40 + 3])
async def test_the_version_is_read_from_values_in_either_form(
    index: Index, stored_as: str, version: int
) -> None:
    """Every script that compares versions reads both the binary form and the JSON form an
    index written before it still holds; a write stores the binary form."""
    value = plan(version) if stored_as == "binary" else json_plan(version)
    for member in ("ns/up", "ns/rm", "ns/fin"):
        await add(index, 0, member, NOW - 1, version=version)
        await index.client.hset(index.keys.sched(0), member, value)
    # upsert.lua: older is stale, the same version already applied, newer written.
    assert await add(index, 0, "ns/up", NOW + 1, version=version - 1) == -1
    due_before = await index.client.zscore(index.keys.due(0), "ns/up")
    assert await add(index, 0, "ns/up", NOW + 1, version=version) == 0
    # The same version again (a rebuild) leaves the rotation and stores the binary form.
    assert await index.client.hget(index.keys.sched(0), "ns/up") == plan(version)
    assert await index.client.zscore(index.keys.due(0), "ns/up") == due_before
    assert await add(index, 0, "ns/up", NOW + 1, version=version + 1) == 1
    stored = await index.client.hget(index.keys.sched(0), "ns/up")
    assert stored == plan(version + 1) and compact.version_of(stored) == version + 1
    # remove.lua: an older removal is stale; a removal at no version buries the stored one.
    assert await index.remove({0: [("ns/rm", version - 1)]}) == {0: [-1]}
    assert await index.remove({0: [("ns/rm", None)]}) == {0: [1]}
    tombstone = await index.client.hget(index.keys.gone(0), "ns/rm")
    assert isinstance(tombstone, bytes) and tombstone.startswith(b"%d|" % version)
    # complete.lua: a finish leaves a tombstone at the stored version, written out in full.
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = next(c.token for c in result.claimed if c.member == "ns/fin")
    done = await index.complete({0: [Completion("ns/fin", token, None, "", finish=True)]}, NOW)
    assert done == {0: [1]}
    assert await index.client.hget(index.keys.gone(0), "ns/fin") == b"%d|%d|f" % (version, NOW)


async def test_an_upsert_stores_the_form_its_index_writes_whatever_it_was_given(
    index: Index,
) -> None:
    """A rebuild is the migration either way: what reaches Redis is in the form the services
    write (CRONBUS_COMPACT_FORM) whatever PostgreSQL holds, at the same version too."""
    upsert = Upsert("ns/old", 4, json_plan(4), "keep", NOW + 5, "")
    assert await index.upsert({1: [upsert]}) == {1: [1]}
    assert await index.client.hget(index.keys.sched(1), "ns/old") == plan(4)
    as_json = Index(index.client, index.keys, index.shards, "json")
    upsert = Upsert("ns/old", 4, plan(4), "keep", NOW + 5, "")
    assert await as_json.upsert({1: [upsert]}) == {1: [0]}
    assert await index.client.hget(index.keys.sched(1), "ns/old") == json_plan(4)
    assert await index.client.zscore(index.keys.due(1), "ns/old") == NOW + 5


async def raw_upsert(index: Index, member: str, version: int, value: bytes) -> int:
    """upsert.lua given this value as it is (Index.upsert converts it to its form first)."""
    script_keys = index._keys(0, "due", "lease", "occ", "sched", "gone", "bf", "pkm")
    [codes] = await index.run([("upsert", script_keys, [member, version, value, "keep", NOW, ""])])
    return int(codes[0])


async def test_a_value_at_version_123_is_read_as_binary(index: Index) -> None:
    """msgpack packs 123 as the one byte ``{``: a binary value at that version begins like a
    JSON one. Read as JSON it had no version: a stale write replaced it, a delete buried
    nothing, and Python could neither decode it nor read its version."""
    assert await raw_upsert(index, "ns/s", 123, plan(123)) == 1
    assert await raw_upsert(index, "ns/s", 122, plan(122)) == -1
    assert await index.client.hget(index.keys.sched(0), "ns/s") == plan(123)
    assert await index.remove({0: [("ns/s", None)]}) == {0: [1]}
    tombstone = await index.client.hget(index.keys.gone(0), "ns/s")
    assert isinstance(tombstone, bytes) and tombstone.startswith(b"123|")
    # The same version in the other form swaps the form, either way, and nothing else.
    as_json = compact.encode_json(Plan(123, IntervalRule(60_000), WebhookPlan("http://sink/x")))
    assert await raw_upsert(index, "ns/t", 123, plan(123)) == 1
    assert await raw_upsert(index, "ns/t", 123, as_json) == 0
    assert await index.client.hget(index.keys.sched(0), "ns/t") == as_json
    assert await raw_upsert(index, "ns/t", 123, plan(123)) == 0
    assert await index.client.hget(index.keys.sched(0), "ns/t") == plan(123)
    # Through the Index: either form given, the configured one stored.
    assert await add(index, 0, "ns/u", NOW + 1, version=123) == 1
    json_index = Index(index.client, index.keys, index.shards, "json")
    upsert = Upsert("ns/u", 123, plan(123), "keep", NOW + 1, "")
    assert await json_index.upsert({0: [upsert]}) == {0: [0]}
    assert await index.client.hget(index.keys.sched(0), "ns/u") == as_json
