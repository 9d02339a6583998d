"""park.lua, wakes.lua and unpark.lua against the real Redis: a held occurrence is parked once
(in due at its safety deadline, listed behind its rate key), released in bulk when told, and a
member paused, deleted or claimed meanwhile is never released."""

from __future__ import annotations

import time

from shared.contract.entries import occ_state
from shared.policy.holds import safety_ms_of
from shared.redis import holds
from shared.redis.holds import ToPark, ToRelease
from shared.redis.index import Index
from tests.lua.test_scripts import LEASE_MS, NOW, add

KEY = "ns|http://127.0.0.1:80"
SAFETY = 900_000
LIMIT = "0.000|1"


async def claimed_token(index: Index, shard: int, member: str, fire: int) -> int:
    await add(index, shard, member, fire)
    result = (await index.claim([shard], 100, LEASE_MS, now_ms=fire))[0]
    return next(c.token for c in result.claimed if c.member == member)


async def park(index: Index, member: str, token: int, wake: int, now: int = NOW) -> int:
    codes = await holds.park(
        index, {0: [ToPark(member, token, KEY, wake, LIMIT)]}, SAFETY, now_ms=now
    )
    return codes[0][0]


async def test_park_moves_the_lease_to_due_at_the_safety_deadline_and_registers_the_key(
    index: Index,
) -> None:
    token = await claimed_token(index, 0, "ns/a", NOW)
    assert await park(index, "ns/a", token, NOW + 30_000) == 1
    due, lease, occ = await index.position(0, "ns/a")
    assert (due, lease) == (NOW + 30_000 + safety_ms_of("ns/a", SAFETY), None)
    assert occ == occ_state(NOW, 1, "", 0, "c")  # attempt kept, no token, a catch-up
    # Not claimable while parked, even after the wake: only a release brings it back.
    assert (await index.claim([0], 10, LEASE_MS, now_ms=NOW + 60_000))[0].claimed == []
    now, woken = await holds.wakes(index, 10, now_ms=NOW + 30_000)
    assert now == NOW + 30_000
    assert [(w.shard, w.rate_key, w.wake_ms, w.limit) for w in woken] == [
        (0, KEY, NOW + 30_000, LIMIT)
    ]
    assert (await holds.wakes(index, 10, now_ms=NOW + 29_999))[1] == []
    # A stale token parks nothing.
    assert await park(index, "ns/a", token, NOW + 30_000) == 0


async def test_the_earliest_wake_wins(index: Index) -> None:
    a = await claimed_token(index, 0, "ns/a", NOW)
    b = await claimed_token(index, 0, "ns/b", NOW)
    await park(index, "ns/a", a, NOW + 30_000)
    await park(index, "ns/b", b, NOW + 10_000)
    woken = (await holds.wakes(index, 10, now_ms=NOW + 60_000))[1]
    assert [w.wake_ms for w in woken] == [NOW + 10_000]


async def test_unpark_releases_the_count_spread_and_keeps_the_rest_parked(index: Index) -> None:
    members = [f"ns/m{i}" for i in range(5)]
    for member in members:
        await park(index, member, await claimed_token(index, 0, member, NOW), NOW + 1000)
    later = NOW + 2000
    released = await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 1000, 2, later + 500)]}, 100, now_ms=later
    )
    assert released == {0: [(2, 3)]}
    result = (await index.claim([0], 10, LEASE_MS, now_ms=later + 100))[0]
    assert len(result.claimed) == 2
    assert all(c.catch_up and c.attempt == 1 for c in result.claimed)
    assert (await holds.wakes(index, 10, now_ms=later + 500))[1][0].wake_ms == later + 500
    # The rest, all at once; the key leaves the registry with its last member.
    assert await holds.unpark(
        index, {0: [ToRelease(KEY, later + 500, 1000, later + 999)]}, 0, now_ms=later + 500
    ) == {0: [(3, 0)]}
    assert (await holds.wakes(index, 10, now_ms=NOW + 10**9))[1] == []
    assert await holds.parked_count(index, 0, KEY) == 0


async def test_unpark_is_fenced_by_the_wake_it_read(index: Index) -> None:
    await park(index, "ns/a", await claimed_token(index, 0, "ns/a", NOW), NOW + 1000)
    fenced = await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 999, 10, NOW + 5000)]}, 0, now_ms=NOW + 2000
    )
    assert fenced == {0: [(-1, 1)]}
    # Nothing released: still at its deadline.
    assert (await index.position(0, "ns/a"))[0] == NOW + 1000 + safety_ms_of("ns/a", SAFETY)


async def test_rewake_releases_nothing_and_moves_the_wake(index: Index) -> None:
    await park(index, "ns/a", await claimed_token(index, 0, "ns/a", NOW), NOW + 1000)
    assert await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 1000, 0, NOW + 31_000)]}, 0, now_ms=NOW + 1000
    ) == {0: [(0, 1)]}
    assert (await holds.wakes(index, 10, now_ms=NOW + 31_000))[1][0].wake_ms == NOW + 31_000


async def test_paused_deleted_or_claimed_members_are_dropped_not_released(index: Index) -> None:
    for member in ("ns/paused", "ns/deleted", "ns/claimed", "ns/kept"):
        await park(index, member, await claimed_token(index, 0, member, NOW), NOW + 1000)
    await add(index, 0, "ns/paused", NOW + 5000, version=2, mode="park")
    await index.remove({0: [("ns/deleted", None)]}, now_ms=NOW)
    # The safety deadline came: claimed (in lease, with a token) before any release.
    deadline = NOW + 1000 + SAFETY
    await index.client.zadd(index.keys.due(0), {"ns/claimed": NOW})
    claimed = (await index.claim([0], 10, LEASE_MS, now_ms=NOW + 1))[0].claimed
    assert [c.member for c in claimed] == ["ns/claimed"]
    released = await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 1000, 10, NOW + 9000)]}, 0, now_ms=NOW + 2000
    )
    assert released == {0: [(1, 0)]}
    assert (await index.position(0, "ns/kept"))[0] == NOW + 2000
    assert (await index.position(0, "ns/paused"))[0] is None
    assert (await index.position(0, "ns/deleted"))[0] is None
    assert (await index.position(0, "ns/claimed"))[1] is not None  # still in flight
    assert deadline > NOW


async def test_a_reset_while_parked_is_not_moved_by_a_release(index: Index) -> None:
    await park(index, "ns/a", await claimed_token(index, 0, "ns/a", NOW), NOW + 1000)
    await add(index, 0, "ns/a", NOW + 120_000, version=2, mode="reset")
    assert await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 1000, 10, NOW + 9000)]}, 0, now_ms=NOW + 2000
    ) == {0: [(0, 0)]}
    assert (await index.position(0, "ns/a"))[0] == NOW + 120_000


async def test_nudge_wakes_a_parked_key_now_and_adds_none_elsewhere(index: Index) -> None:
    await park(index, "ns/a", await claimed_token(index, 0, "ns/a", NOW), NOW + 30_000)
    await holds.nudge(index, [KEY])
    woken = (await holds.wakes(index, 10, now_ms=NOW))[1]
    assert [(w.shard, w.wake_ms) for w in woken] == [(0, 0)]
    assert await index.client.zcard(index.keys.parked(1)) == 0


async def test_members_parked_together_come_due_by_themselves_spread_out(index: Index) -> None:
    members = [f"ns/m{i}" for i in range(50)]
    for member in members:
        await park(index, member, await claimed_token(index, 0, member, NOW), NOW + 1000)
    deadlines = [(await index.position(0, m))[0] for m in members]
    assert all(d is not None for d in deadlines)
    # Not one millisecond for all: over +-10% of the safety time.
    assert len(set(deadlines)) > 40
    assert all(abs(d - (NOW + 1000 + SAFETY)) <= SAFETY // 10 for d in deadlines if d)


async def test_a_write_that_keeps_the_rotation_releases_a_parked_occurrence(
    index: Index,
) -> None:
    # Its schedule changed (a new target, perhaps under another rate key): it comes due now,
    # not at its safety deadline, and a release later finds nothing of it parked.
    await park(index, "ns/a", await claimed_token(index, 0, "ns/a", NOW), NOW + 30_000)
    before = int(time.time() * 1000)
    assert await add(index, 0, "ns/a", NOW + 999_999, version=2, mode="keep") == 1
    due, lease, occ = await index.position(0, "ns/a")
    assert due is not None and before - 1000 <= due <= int(time.time() * 1000) + 1000
    assert (lease, occ) == (None, occ_state(NOW, 1, "", 0, "c"))  # same occurrence, attempt
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0
    assert await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 30_000, 10, NOW + 39_000)]}, 0, now_ms=NOW + 30_000
    ) == {0: [(0, 0)]}
    assert (await index.position(0, "ns/a"))[0] == due


async def test_a_write_of_an_occurrence_not_parked_leaves_it_where_it_is(index: Index) -> None:
    await add(index, 0, "ns/a", NOW + 5000)
    assert await add(index, 0, "ns/a", NOW + 9000, version=2, mode="keep") == 1
    assert (await index.position(0, "ns/a"))[0] == NOW + 5000
    # Released and claimed since its parking: a later write does not move it either.
    await park(index, "ns/b", await claimed_token(index, 0, "ns/b", NOW), NOW + 1000)
    await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 1000, 10, NOW + 9000)]}, 0, now_ms=NOW + 2000
    )
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0
    assert await add(index, 0, "ns/b", NOW + 9000, version=2, mode="keep") == 1
    assert (await index.position(0, "ns/b"))[0] == NOW + 2000


async def test_pause_and_delete_take_the_parked_mark_with_them(index: Index) -> None:
    for member in ("ns/paused", "ns/deleted"):
        await park(index, member, await claimed_token(index, 0, member, NOW), NOW + 1000)
    assert await index.client.hlen(index.keys.parked_marks(0)) == 2
    await add(index, 0, "ns/paused", NOW + 5000, version=2, mode="park")
    await index.remove({0: [("ns/deleted", None)]}, now_ms=NOW)
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0


async def test_wipe_drops_the_parked_sets_marks_and_probe_turns(index: Index) -> None:
    for shard, member in ((0, "ns/a"), (1, "ns/b")):
        token = await claimed_token(index, shard, member, NOW)
        await holds.park(
            index, {shard: [ToPark(member, token, KEY, NOW + 1000, LIMIT)]}, SAFETY, now_ms=NOW
        )
        await index.client.zadd(index.keys.probed(shard, KEY), {member: 1})
    await index.wipe()
    left = [
        k.decode() if isinstance(k, bytes) else k
        for k in await index.client.keys(index.keys.prefix + ":*")
    ]
    # Only the token sequences stay (a token is never handed out twice).
    assert sorted(left) == sorted(index.keys.seq(s) for s in (0, 1))
