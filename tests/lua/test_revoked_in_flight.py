"""A reset (or a pause and resume) while an occurrence is in flight: the old occurrence is
revoked, and its delivery may still be under way. The new rotation's first occurrence must wait
for it to end, so one schedule never has two occurrences in flight (invariant 3); found by the
ledger's 20-minute run (seed 52842): a reset 600 ms into a 1.2 s delivery, and the new
rotation's first occurrence was delivered 400 ms later, while the old one was still running."""

from __future__ import annotations

from shared.contract.entries import Completion
from shared.redis.index import Index
from tests.lua.test_scripts import LEASE_MS, NOW, add, snapshot


async def claim_one(index: Index, at_ms: int) -> list[tuple[str, int, bool]]:
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=at_ms)
    return [(c.member, c.nominal_ms, c.catch_up) for c in result.claimed]


async def in_flight(index: Index, member: str) -> int:
    await add(index, 0, member, NOW - 1)
    [result] = await index.claim([0], limit=10, lease_ms=LEASE_MS, now_ms=NOW)
    token = result.claimed[0].token
    _, codes = await index.begin({0: [(member, token, 5_000)]}, now_ms=NOW)
    assert codes == {0: [1]}
    return token


async def test_the_new_rotation_waits_for_the_revoked_occurrence_to_end(index: Index) -> None:
    token = await in_flight(index, "ns/r")
    await add(index, 0, "ns/r", NOW + 100, version=2, mode="reset")
    # Due, but the revoked delivery is still running: not claimed, pushed back a little.
    assert await claim_one(index, NOW + 200) == []
    assert await claim_one(index, NOW + 300) == []
    # The old delivery ends (its completion is stale: nothing of the old rotation moves).
    assert await index.complete({0: [Completion("ns/r", token, NOW + 60_000)]}) == {0: [0]}
    # Now the new rotation's first occurrence goes, as a catch-up (its wait is not lateness).
    assert await claim_one(index, NOW + 800) == [("ns/r", NOW + 100, True)]


async def test_a_stale_retry_also_frees_the_new_rotation(index: Index) -> None:
    token = await in_flight(index, "ns/t")
    await add(index, 0, "ns/t", NOW + 100, version=2, mode="reset")
    assert await claim_one(index, NOW + 200) == []
    assert await index.retry({0: [("ns/t", token, 1000)]}) == {0: [0]}
    assert await claim_one(index, NOW + 800) == [("ns/t", NOW + 100, True)]


async def test_a_pause_and_resume_during_the_delivery_wait_for_it_too(index: Index) -> None:
    token = await in_flight(index, "ns/p")
    await add(index, 0, "ns/p", NOW + 100, version=2, mode="park")
    await add(index, 0, "ns/p", NOW + 100, version=3, mode="resume")
    assert await claim_one(index, NOW + 200) == []
    await index.complete({0: [Completion("ns/p", token, NOW + 60_000)]})
    assert [m for m, _, _ in await claim_one(index, NOW + 800)] == ["ns/p"]


async def test_an_executor_that_died_mid_delivery_holds_the_rotation_only_until_its_lease(
    index: Index,
) -> None:
    await in_flight(index, "ns/d")
    await add(index, 0, "ns/d", NOW + 100, version=2, mode="reset")
    assert await claim_one(index, NOW + LEASE_MS - 100) == []
    # Its lease has run out: the delivery is over, or will be redone by the sweeper anyway.
    assert await claim_one(index, NOW + LEASE_MS + 300) == [("ns/d", NOW + 100, True)]
    assert b"ns/d!" not in (await snapshot(index, 0))["occ"]  # type: ignore[operator]


async def test_a_reset_of_a_schedule_not_in_flight_waits_for_nothing(index: Index) -> None:
    await add(index, 0, "ns/n", NOW + 5_000)
    await add(index, 0, "ns/n", NOW + 100, version=2, mode="reset")
    assert await claim_one(index, NOW + 200) == [("ns/n", NOW + 100, False)]
    assert b"ns/n!" not in (await snapshot(index, 0))["occ"]  # type: ignore[operator]


async def test_a_delete_and_recreate_waits_for_the_deleted_delivery_too(index: Index) -> None:
    # Deleted while delivering, then created again under the same id: still one schedule
    # (ns/x) to its target, so the recreated one's first occurrence waits for the old delivery.
    token = await in_flight(index, "ns/x")
    assert await index.remove({0: [("ns/x", 1)]}, now_ms=NOW + 50) == {0: [1]}
    await add(index, 0, "ns/x", NOW + 100, version=2, mode="reset")
    assert await claim_one(index, NOW + 800) == []
    assert await index.complete({0: [Completion("ns/x", token, NOW + 60_000)]}) == {0: [0]}
    assert await claim_one(index, NOW + 1_200) == [("ns/x", NOW + 100, True)]


async def test_a_deleted_schedules_marker_goes_with_its_tombstone_once_expired(
    index: Index,
) -> None:
    await in_flight(index, "ns/y")
    await add(index, 0, "ns/y", NOW + 100, version=2, mode="reset")
    await index.remove({0: [("ns/y", 2)]}, now_ms=NOW + 50)
    gone = await index.client.hget(index.keys.gone(0), "ns/y")
    assert isinstance(gone, bytes)
    # Its delivery may still run (the deadline is ahead of the server clock): both stay, so a
    # recreate still waits.
    assert await index.forget(0, [("ns/y", gone)]) == 0
    assert b"ns/y!" in (await snapshot(index, 0))["occ"]  # type: ignore[operator]
    # Once the deadline has passed, the tombstone and the marker go together: nothing leaks.
    await index.client.hset(index.keys.occ(0), "ns/y!", "1|1000")
    assert await index.forget(0, [("ns/y", gone)]) == 1
    assert (await snapshot(index, 0))["occ"] == {}


async def test_a_stale_begin_from_another_copy_does_not_free_the_new_rotation(
    index: Index,
) -> None:
    # The broker redelivers a message whose first copy is still delivering (its channel
    # dropped): the second copy's begin finds the token stale. That says nothing of the first
    # copy, still running: the new rotation keeps waiting until that one ends.
    token = await in_flight(index, "ns/c")
    await add(index, 0, "ns/c", NOW + 100, version=2, mode="reset")
    _, codes = await index.begin({0: [("ns/c", token, 5_000)]}, now_ms=NOW + 150)
    assert codes == {0: [0]}
    assert await claim_one(index, NOW + 800) == []
    # The delivering copy ends: now the new rotation goes.
    assert await index.complete({0: [Completion("ns/c", token, NOW + 60_000)]}) == {0: [0]}
    assert await claim_one(index, NOW + 1_200) == [("ns/c", NOW + 100, True)]


async def test_a_tombstone_without_a_marker_is_forgotten_as_before(index: Index) -> None:
    await add(index, 0, "ns/z", NOW + 5_000)
    await index.remove({0: [("ns/z", 1)]}, now_ms=NOW)
    gone = await index.client.hget(index.keys.gone(0), "ns/z")
    assert isinstance(gone, bytes)
    assert await index.forget(0, [("ns/z", gone)]) == 1
    assert await index.client.hget(index.keys.gone(0), "ns/z") is None
