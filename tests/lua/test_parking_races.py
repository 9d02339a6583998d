"""Parking under the races a review looked for, against the real Redis: an executor that dies
between park and ack, a reclaim racing a park, a write releasing an occurrence a release is
about to take, a parked mark left behind, a rebuild while parked, and every key of each call
in its shard's one hash slot (Redis Cluster)."""

from __future__ import annotations

import time
from typing import Any

from redis.crc import key_slot

from shared.contract.entries import BackfillStart, Completion, occ_state
from shared.policy.holds import safety_ms_of
from shared.redis import holds
from shared.redis.holds import ToPark, ToRelease
from shared.redis.index import Index
from tests.lua.test_parking import KEY, LIMIT, SAFETY, claimed_token, park
from tests.lua.test_scripts import LEASE_MS, NOW, add


async def test_the_message_of_a_parked_occurrence_redelivered_after_a_crash_is_stale(
    index: Index,
) -> None:
    # The executor parked it, then died before its ack: the broker hands the message to
    # another executor, which must neither deliver nor settle it (its token is gone).
    token = await claimed_token(index, 0, "ns/a", NOW)
    assert await park(index, "ns/a", token, NOW + 30_000) == 1
    parked_at = await index.position(0, "ns/a")
    assert (await index.begin({0: [("ns/a", token, 60_000)]}, now_ms=NOW + 1))[1] == {0: [0]}
    assert await index.complete({0: [Completion("ns/a", token, NOW + 60_000)]}) == {0: [0]}
    assert await park(index, "ns/a", token, NOW + 40_000) == 0
    assert await index.position(0, "ns/a") == parked_at


async def test_a_reclaim_and_a_park_of_one_lease_never_both_act(index: Index) -> None:
    # Reclaim first: the park finds its token gone and leaves the occurrence due, once.
    token = await claimed_token(index, 0, "ns/a", NOW)
    assert await index.reclaim([0], 10, now_ms=NOW + LEASE_MS + 1) == {0: (1, 0)}
    assert await park(index, "ns/a", token, NOW + 30_000) == 0
    assert await index.position(0, "ns/a") == (NOW + LEASE_MS + 1, None, occ_state(NOW, 1, "", 0))
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0
    # Park first: nothing is left in lease for the reclaim to take.
    token = await claimed_token(index, 1, "ns/b", NOW)
    codes = await holds.park(
        index, {1: [ToPark("ns/b", token, KEY, NOW + 30_000, LIMIT)]}, SAFETY, now_ms=NOW
    )
    assert codes == {1: [1]}
    assert await index.reclaim([1], 10, now_ms=NOW + LEASE_MS + 1) == {1: (0, 0)}
    deadline = NOW + 30_000 + safety_ms_of("ns/b", SAFETY)
    assert await index.position(1, "ns/b") == (deadline, None, occ_state(NOW, 1, "", 0, "c"))


async def test_an_occurrence_released_by_a_write_is_not_released_again(index: Index) -> None:
    # A keep-write releases it (due now), a dispatcher claims it; the key's release that comes
    # next finds it gone from its parked place: one occurrence in flight, never two.
    token = await claimed_token(index, 0, "ns/a", NOW)
    await park(index, "ns/a", token, NOW + 1000)
    assert await add(index, 0, "ns/a", NOW + 999_999, version=2, mode="keep") == 1
    [first] = await index.claim([0], 10, LEASE_MS, now_ms=NOW + 2000)
    assert [c.member for c in first.claimed] == ["ns/a"]
    assert await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 1000, 10, NOW + 9000)]}, 0, now_ms=NOW + 2000
    ) == {0: [(0, 0)]}
    [second] = await index.claim([0], 10, LEASE_MS, now_ms=NOW + 10**9)
    assert second.claimed == []


async def test_a_parked_mark_left_behind_moves_no_later_occurrence(index: Index) -> None:
    # Nobody released it: it came due by itself at its safety deadline, was claimed and
    # delivered, and its next occurrence is in due. Its mark (and its entry in the key's set)
    # stayed; neither a write nor the key's release moves the new occurrence.
    token = await claimed_token(index, 0, "ns/a", NOW)
    await park(index, "ns/a", token, NOW + 1000)
    deadline = NOW + 1000 + safety_ms_of("ns/a", SAFETY)
    [again] = await index.claim([0], 10, LEASE_MS, now_ms=deadline)
    [claimed] = again.claimed
    next_fire = deadline + 60_000
    done = await index.complete({0: [Completion("ns/a", claimed.token, next_fire)]})
    assert done == {0: [1]}
    assert await index.client.hget(index.keys.parked_marks(0), "ns/a") is not None
    assert await add(index, 0, "ns/a", NOW, version=2, mode="keep") == 1
    assert (await index.position(0, "ns/a"))[0] == next_fire
    await park(index, "ns/b", await claimed_token(index, 0, "ns/b", NOW), NOW + 1000)
    released = await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 1000, 10, NOW + 9000)]}, 0, now_ms=deadline + 1
    )
    assert released == {0: [(1, 0)]}  # ns/b only
    assert (await index.position(0, "ns/a"))[0] == next_fire
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0


async def test_a_rebuild_while_parked_leaves_one_occurrence_and_no_parking(index: Index) -> None:
    token = await claimed_token(index, 0, "ns/a", NOW)
    await park(index, "ns/a", token, NOW + 1000)
    await index.wipe()
    assert await add(index, 0, "ns/a", NOW + 5000, mode="reset") == 1
    assert (await index.position(0, "ns/a"))[0] == NOW + 5000
    assert (await holds.wakes(index, 10, now_ms=NOW + 10**9))[1] == []
    # The release an executor read before the rebuild is fenced off: nothing moves.
    assert await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 1000, 10, NOW + 9000)]}, 0, now_ms=NOW + 2000
    ) == {0: [(-1, 0)]}
    assert (await index.position(0, "ns/a"))[0] == NOW + 5000


async def test_every_call_touches_one_hash_slot(index: Index) -> None:
    # Redis Cluster runs a script only when all its keys are in one slot: the shard's.
    seen: list[tuple[str, list[str]]] = []
    run, pipeline = index.run, index._pipeline

    async def spy_run(calls: Any) -> list[Any]:
        seen.extend((name, list(keys)) for name, keys, _ in calls)
        return await run(calls)

    async def spy_pipeline(calls: Any) -> list[Any]:
        seen.extend((name, list(keys)) for name, keys, _ in calls)
        return await pipeline(calls)

    index.run, index._pipeline = spy_run, spy_pipeline  # type: ignore[method-assign]
    for shard in (0, 3):
        member = f"ns/s{shard}"
        token = await claimed_token(index, shard, member, NOW)
        await holds.park(
            index, {shard: [ToPark(member, token, KEY, NOW + 1000, LIMIT)]}, SAFETY, now_ms=NOW
        )
        await add(index, shard, member, NOW, version=2, mode="keep")
        await holds.wakes(index, 10, now_ms=NOW + 1000)
        await holds.unpark(
            index,
            {shard: [ToRelease(KEY, NOW + 1000, 1, NOW + 2000, probe=True)]},
            0,
            now_ms=NOW + 1000,
        )
        await index.remove({shard: [(member, None)]}, now_ms=NOW)
    names = {name for name, _ in seen}
    assert {"park", "upsert", "wakes", "unpark", "remove"} <= names
    for name, keys in seen:
        assert len({key_slot(k.encode()) for k in keys}) == 1, (name, keys)


async def test_a_write_that_keeps_the_rotation_releases_a_parked_backfill_too(
    index: Index,
) -> None:
    # The schedule moved to a healthy target: its backfill's parked occurrence comes due now
    # as its regular one does, not after the old target's cooldown or its safety deadline.
    member, backfill = "ns/s", "ns/s#b"
    await add(index, 0, member, NOW + 3_600_000)
    assert await index.start_backfill(0, BackfillStart(member, 1, NOW - 1000, 3, NOW - 60_000))
    [result] = await index.claim([0], 10, LEASE_MS, now_ms=NOW)
    [claimed] = result.claimed
    assert claimed.member == backfill
    codes = await holds.park(
        index,
        {0: [ToPark(backfill, claimed.token, KEY, NOW + 30_000, LIMIT)]},
        SAFETY,
        now_ms=NOW,
    )
    assert codes == {0: [1]}
    before = int(time.time() * 1000)
    assert await add(index, 0, member, NOW + 3_600_000, version=2, mode="keep") == 1
    due = (await index.position(0, backfill))[0]
    assert due is not None and before - 1000 <= due <= int(time.time() * 1000) + 1000
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0


async def test_a_pause_takes_a_parked_backfills_mark_with_it(index: Index) -> None:
    member, backfill = "ns/s", "ns/s#b"
    await add(index, 0, member, NOW + 3_600_000)
    assert await index.start_backfill(0, BackfillStart(member, 1, NOW - 1000, 3, NOW - 60_000))
    [result] = await index.claim([0], 10, LEASE_MS, now_ms=NOW)
    [claimed] = result.claimed
    await holds.park(
        index,
        {0: [ToPark(backfill, claimed.token, KEY, NOW + 30_000, LIMIT)]},
        SAFETY,
        now_ms=NOW,
    )
    assert await add(index, 0, member, NOW + 3_600_000, version=2, mode="park") == 1
    assert (await index.position(0, backfill))[0] is None
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0


async def test_a_delete_takes_a_parked_backfills_mark_with_it(index: Index) -> None:
    member, backfill = "ns/s", "ns/s#b"
    await add(index, 0, member, NOW + 3_600_000)
    assert await index.start_backfill(0, BackfillStart(member, 1, NOW - 1000, 3, NOW - 60_000))
    [result] = await index.claim([0], 10, LEASE_MS, now_ms=NOW)
    [claimed] = result.claimed
    await holds.park(
        index,
        {0: [ToPark(backfill, claimed.token, KEY, NOW + 30_000, LIMIT)]},
        SAFETY,
        now_ms=NOW,
    )
    await index.remove({0: [(member, None)]}, now_ms=NOW)
    assert (await index.position(0, backfill))[0] is None
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0


async def test_an_occurrence_whose_schedule_was_written_in_flight_is_not_parked(
    index: Index,
) -> None:
    # Claimed under version 1; its schedule moves to a new target (version 2, keep) while it
    # is in flight, so the write finds nothing parked to release. The executor, holding the
    # old target, would park it behind the old key: it comes due now instead, and is judged
    # by its new target when claimed again.
    token = await claimed_token(index, 0, "ns/a", NOW)
    assert await add(index, 0, "ns/a", NOW + 999_999, version=2, mode="keep") == 1
    codes = await holds.park(
        index, {0: [ToPark("ns/a", token, KEY, NOW + 30_000, LIMIT, 1)]}, SAFETY, now_ms=NOW
    )
    assert codes == {0: [2]}
    assert await index.position(0, "ns/a") == (NOW, None, occ_state(NOW, 1, "", 0, "c"))
    assert await index.client.hlen(index.keys.parked_marks(0)) == 0
    assert await holds.parked_count(index, 0, KEY) == 0
    assert (await holds.wakes(index, 10, now_ms=NOW + 10**9))[1] == []
    # Under the version it holds, it is parked as before.
    token = await claimed_token(index, 0, "ns/b", NOW)
    codes = await holds.park(
        index, {0: [ToPark("ns/b", token, KEY, NOW + 30_000, LIMIT, 1)]}, SAFETY, now_ms=NOW
    )
    assert codes == {0: [1]}
