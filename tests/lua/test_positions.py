"""Positions of the index (advance.lua) and the claim fence (claim.lua, invariant 9): a shard
whose position is behind a command already answered gives nothing to claim. Runs outside the
rotation (run.lua, backfill.lua) are written with their position, once."""

from __future__ import annotations

import random
import time

from shared.contract.entries import BackfillStart, Completion
from shared.redis.index import Index
from tests.lua.test_scripts import LEASE_MS, NOW, add


async def test_positions_written_out_of_order_count_once_the_gap_closes(index: Index) -> None:
    assert await index.advance({3: 1}, "note") == {3: 1}
    assert await index.advance({3: 3}, "note") == {3: 1}  # 2 not applied yet: 3 waits
    assert await index.advance({3: 4}, "note") == {3: 1}
    assert await index.advance({3: 2}, "note") == {3: 4}  # the gap closed: 3 and 4 count
    assert (await index.positions())[3] == 4
    assert await index.client.zcard(index.keys.ahead(3)) == 0


async def test_a_position_already_applied_changes_nothing(index: Index) -> None:
    await index.advance({0: 5}, "floor")
    assert await index.advance({0: 2}, "note") == {0: 5}
    assert await index.advance({0: 3}, "floor") == {0: 5}


async def test_a_floor_takes_the_positions_waiting_past_it(index: Index) -> None:
    await index.advance({0: 7}, "note")
    await index.advance({0: 9}, "note")
    assert await index.advance({0: 6}, "floor") == {0: 7}
    assert await index.advance({0: 8}, "floor") == {0: 9}


async def test_start_sets_a_position_only_where_there_is_none(index: Index) -> None:
    await index.advance({1: 4}, "floor")
    assert await index.advance({0: 10, 1: 10}, "start") == {0: 10, 1: 4}


async def test_any_order_of_notes_ends_at_the_last(index: Index) -> None:
    rng = random.Random(21)
    for _ in range(40):
        await index.client.delete(index.keys.position(0), index.keys.ahead(0))
        order = list(range(1, 13))
        rng.shuffle(order)
        for position in order:
            await index.advance({0: position}, "note")
        assert (await index.positions())[0] == 12, order
        assert await index.client.zcard(index.keys.ahead(0)) == 0, order


async def test_a_shard_behind_an_answered_command_is_fenced(index: Index) -> None:
    await add(index, 0, "ns/a", NOW - 1)
    await index.advance({0: 4}, "floor")
    [fenced] = await index.claim([0], 10, LEASE_MS, now_ms=NOW, answered={0: 5})
    assert fenced.fenced and fenced.claimed == []
    # Still due, untouched: claimed once the shard has caught up.
    await index.advance({0: 5}, "note")
    [result] = await index.claim([0], 10, LEASE_MS, now_ms=NOW, answered={0: 5})
    assert not result.fenced
    assert [c.member for c in result.claimed] == ["ns/a"]


async def test_a_shard_with_no_position_is_fenced_once_anything_was_answered(
    index: Index,
) -> None:
    await add(index, 0, "ns/a", NOW - 1)
    [fenced] = await index.claim([0], 10, LEASE_MS, now_ms=NOW, answered={0: 1})
    assert fenced.fenced
    # Another shard's answered position fences only that shard.
    [free] = await index.claim([0], 10, LEASE_MS, now_ms=NOW, answered={1: 9})
    assert not free.fenced and [c.member for c in free.claimed] == ["ns/a"]


async def test_without_answered_positions_claims_are_not_fenced(index: Index) -> None:
    await add(index, 0, "ns/a", NOW - 1)
    [result] = await index.claim([0], 10, LEASE_MS, now_ms=NOW)
    assert not result.fenced and [c.member for c in result.claimed] == ["ns/a"]


async def test_waiting_for_replicas_follows_the_position_on_its_connection(index: Index) -> None:
    """With no replica to acknowledge, WAIT returns at its timeout: the position is recorded
    all the same (the reply is only delayed, never refused)."""
    started = time.monotonic()
    assert await index.advance({0: 1}, "note", wait_replicas=1, wait_timeout_ms=80) == {0: 1}
    assert time.monotonic() - started >= 0.07
    assert (await index.positions())[0] == 1


async def test_a_run_and_its_position_are_written_once_whoever_comes_first(index: Index) -> None:
    """run.lua: the intake after its commit and the sweeper's replay both write a trigger with
    the position of its transaction; the second finds the position applied and writes nothing,
    even though the run was claimed and completed in between (it must not run twice)."""
    await add(index, 0, "ns/a", NOW + 3_600_000)
    await index.advance({0: 4}, "floor")
    member = f"ns/a#{NOW - 1}"
    assert await index.add_run(0, member, NOW - 1, 5) is True
    assert (await index.positions())[0] == 5
    [result] = await index.claim([0], 10, LEASE_MS, now_ms=NOW)
    [taken] = result.claimed
    assert taken.member == member
    await index.complete({0: [Completion(member, taken.token, None)]}, now_ms=NOW)
    assert await index.add_run(0, member, NOW - 1, 5) is False  # the replay, second
    assert await index.position(0, member) == (None, None, None)


async def test_a_run_past_a_gap_counts_as_applied(index: Index) -> None:
    await index.advance({0: 4}, "floor")
    assert await index.add_run(0, "ns/a#1", 1, 6) is True  # 5 not applied yet: 6 waits
    assert (await index.positions())[0] == 4
    await index.client.zrem(index.keys.due(0), "ns/a#1")  # claimed and completed, say
    assert await index.add_run(0, "ns/a#1", 1, 6) is False
    assert await index.add_run(0, "ns/b#1", 1, 5) is True  # the gap closes
    assert (await index.positions())[0] == 6


async def test_a_run_lost_with_its_position_is_written_again(index: Index) -> None:
    """A failover to a replica that lacks both: the replay writes it."""
    await index.advance({0: 4}, "floor")
    assert await index.add_run(0, "ns/a#1", 1, 5) is True
    await index.client.delete(index.keys.position(0), index.keys.due(0))
    await index.advance({0: 4}, "floor")
    assert await index.add_run(0, "ns/a#1", 1, 5) is True
    assert (await index.position(0, "ns/a#1"))[0] == 1


async def test_a_run_in_flight_is_not_added_again(index: Index) -> None:
    await index.client.zadd(index.keys.lease(0), {"ns/a#1": NOW + LEASE_MS})
    assert await index.add_run(0, "ns/a#1", 1, 1) is False
    assert (await index.positions())[0] == 1  # its position is applied all the same
    assert await index.position(0, "ns/a#1") == (None, NOW + LEASE_MS, None)


async def test_a_backfill_written_with_its_position_is_not_written_again(index: Index) -> None:
    start = BackfillStart("ns/a", 7, NOW - 1000, 3, NOW - 60_000)
    await index.advance({0: 2}, "floor")
    assert await index.start_backfill(0, start, 3) is True
    assert (await index.positions())[0] == 3
    await index.client.hdel(index.keys.backfill(0), "ns/a")  # it ran to its end, say
    assert await index.start_backfill(0, start, 3) is False
    assert await index.backfill_remaining(0, "ns/a") is None
    # Without a position (the rebuild, drift repair) it is written as before.
    assert await index.start_backfill(0, start) is True
    assert await index.backfill_remaining(0, "ns/a") == 3
