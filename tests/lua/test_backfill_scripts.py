"""Backfills in the index against the real Redis: one occurrence of a schedule in flight at a
time (regular or backfill), the chain of a backfill, its replacement, pause, delete and end."""

from __future__ import annotations

import itertools
import random

from shared.contract.entries import BackfillStart, Claimed, ClaimResult, Completion, Upsert
from shared.redis.index import Index
from tests.lua.test_scripts import LEASE_MS, NOW, add, plan

MEMBER = "ns/s"
BACKFILL = "ns/s#b"
HOUR = 3_600_000
#: A backfill over the past: nominal times at NOW - 10h, - 9h, ... (the rule's grid).
FIRST = NOW - 10 * HOUR


async def start(
    index: Index,
    generation: int,
    remaining: int,
    first_ms: int | None = FIRST,
    to_ms: int = NOW - HOUR,
) -> bool:
    return await index.start_backfill(
        0, BackfillStart(MEMBER, generation, to_ms, remaining, first_ms)
    )


async def claim(index: Index, now_ms: int = NOW, limit: int = 10) -> ClaimResult:
    [result] = await index.claim([0], limit=limit, lease_ms=LEASE_MS, now_ms=now_ms)
    return result


async def complete(
    index: Index, member: str, token: int, next_ms: int | None, now_ms: int = NOW
) -> int:
    codes = await index.complete({0: [Completion(member, token, next_ms)]}, now_ms=now_ms)
    return codes[0][0]


async def held(index: Index) -> str | None:
    value = await index.client.hget(index.keys.backfill(0), MEMBER)
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


async def test_a_backfill_member_is_not_leased_while_its_schedule_is_in_flight(
    index: Index,
) -> None:
    await add(index, 0, MEMBER, NOW - 5)
    [regular] = (await claim(index)).claimed
    assert regular.member == MEMBER
    await start(index, 1, 3)
    result = await claim(index)
    assert result.claimed == []
    assert result.waiting == 1
    # Put back a moment, its nominal time kept.
    due, lease, occ = await index.position(0, BACKFILL)
    assert (due, lease) == (NOW + 250, None)
    assert occ is not None and occ.startswith(f"{FIRST}|1||1")
    assert await complete(index, MEMBER, regular.token, NOW + 60_000) == 1
    [taken] = (await claim(index, NOW + 300)).claimed
    assert (taken.member, taken.nominal_ms, taken.fires) == (BACKFILL, FIRST, 1)


async def test_a_regular_occurrence_waits_for_the_backfill_occurrence_in_flight(
    index: Index,
) -> None:
    await add(index, 0, MEMBER, NOW + 1000)
    await start(index, 1, 3)
    [taken] = (await claim(index)).claimed
    assert taken.member == BACKFILL
    result = await claim(index, NOW + 1000)
    assert result.claimed == [] and result.waiting == 1
    due, _, occ = await index.position(0, MEMBER)
    # The regular occurrence keeps its nominal time while its due score moves.
    assert due == NOW + 1000 + 250
    assert occ is not None and occ.startswith(f"{NOW + 1000}|1|")
    assert await complete(index, BACKFILL, taken.token, FIRST + HOUR, NOW + 1100) == 3
    # Both due: the regular occurrence that waited goes first, the backfill's next after it.
    result = await claim(index, NOW + 1300)
    assert [(c.member, c.nominal_ms) for c in result.claimed] == [(MEMBER, NOW + 1000)]
    assert result.waiting == 1
    # It waited: delivered when its turn comes, never judged late for the wait.
    assert result.claimed[0].catch_up


async def test_one_claim_never_takes_both_occurrences_of_a_schedule(index: Index) -> None:
    await add(index, 0, MEMBER, NOW - 5)
    await start(index, 1, 3)
    result = await claim(index)
    # The older (the backfill's first) goes; the regular one waits.
    assert [c.member for c in result.claimed] == [BACKFILL]
    assert result.waiting == 1


async def test_schedules_without_a_backfill_claim_as_before(index: Index) -> None:
    for n in range(5):
        await add(index, 0, f"ns/other-{n}", NOW - n)
    result = await claim(index)
    assert len(result.claimed) == 5 and result.waiting == 0
    assert await index.client.exists(index.keys.backfill(0)) == 0


async def test_a_backfill_goes_on_oldest_first_until_its_count_then_ends(index: Index) -> None:
    await add(index, 0, MEMBER, NOW + 60_000)
    await start(index, 7, 3)
    delivered, codes = [], []
    for step in range(4):
        result = await claim(index, NOW + step)
        if not result.claimed:
            break
        [taken] = result.claimed
        delivered.append(taken.nominal_ms)
        codes.append(await complete(index, BACKFILL, taken.token, taken.nominal_ms + HOUR))
    assert delivered == [FIRST, FIRST + HOUR, FIRST + 2 * HOUR]
    # 1 + what is left after each: the last says it is over.
    assert codes == [3, 2, 1]
    assert await held(index) is None
    assert await index.position(0, BACKFILL) == (None, None, None)


async def test_a_backfill_stops_at_its_end(index: Index) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await start(index, 1, 100, to_ms=FIRST + HOUR + 1)
    [first] = (await claim(index)).claimed
    assert await complete(index, BACKFILL, first.token, FIRST + HOUR) == 100
    [second] = (await claim(index)).claimed
    # The next nominal time is at its `to`: excluded, so the backfill is over.
    assert await complete(index, BACKFILL, second.token, FIRST + 2 * HOUR) == 1
    assert await held(index) is None


async def test_replacing_a_backfill_drops_its_waiting_occurrences(index: Index) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await start(index, 1, 5)
    assert await start(index, 2, 2, first_ms=FIRST + 3 * HOUR)
    [taken] = (await claim(index)).claimed
    assert (taken.nominal_ms, taken.fires) == (FIRST + 3 * HOUR, 2)
    # An older generation arriving late (a slow intake, a repair) changes nothing.
    assert not await start(index, 1, 5)


async def test_a_replaced_backfill_in_flight_finishes_then_the_new_one_starts(
    index: Index,
) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await start(index, 1, 5)
    [old] = (await claim(index)).claimed
    assert await start(index, 2, 2, first_ms=FIRST + 5 * HOUR)
    # The old occurrence is still in flight: nothing of the new backfill may be leased.
    assert (await claim(index, NOW + 1)).claimed == []
    assert await index.backfill_remaining(0, MEMBER) == 2
    # Its completion does not move the new backfill: the new one's first takes its place.
    assert await complete(index, BACKFILL, old.token, FIRST + HOUR) == 1
    [new] = (await claim(index, NOW + 2)).claimed
    assert (new.nominal_ms, new.attempt, new.fires) == (FIRST + 5 * HOUR, 1, 2)
    assert await complete(index, BACKFILL, new.token, FIRST + 6 * HOUR) == 2
    [last] = (await claim(index, NOW + 3)).claimed
    assert last.nominal_ms == FIRST + 6 * HOUR
    assert await complete(index, BACKFILL, last.token, FIRST + 7 * HOUR) == 1
    assert await held(index) is None


async def test_a_replaced_backfill_retried_gives_its_place_to_the_new_one(index: Index) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await start(index, 1, 5)
    [old] = (await claim(index)).claimed
    await start(index, 2, 1, first_ms=FIRST + 4 * HOUR)
    assert (await index.retry({0: [(BACKFILL, old.token, 0)]}, now_ms=NOW))[0] == [1]
    [new] = (await claim(index, NOW + 1)).claimed
    assert (new.nominal_ms, new.attempt, new.fires) == (FIRST + 4 * HOUR, 1, 2)
    # The stale token of the old attempt completes nothing.
    assert await complete(index, BACKFILL, old.token, FIRST + HOUR) == 0


async def test_a_replacement_with_nothing_to_deliver_ends_the_backfill(index: Index) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await start(index, 1, 5)
    assert await start(index, 2, 0, first_ms=None)
    assert await held(index) is None
    assert (await claim(index)).claimed == []


async def test_a_paused_schedules_backfill_waits_for_the_resume(index: Index) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await start(index, 1, 3)
    [taken] = (await claim(index)).claimed
    await index.upsert({0: [Upsert(MEMBER, 2, plan(2), "park", None)]})
    # The occurrence in flight finishes; the next one waits, out of due.
    assert await complete(index, BACKFILL, taken.token, FIRST + HOUR) == 3
    due, lease, occ = await index.position(0, BACKFILL)
    assert (due, lease) == (None, None) and occ is not None
    assert (await claim(index, NOW + HOUR)).claimed == []
    await index.upsert({0: [Upsert(MEMBER, 3, plan(3), "resume", NOW + 2 * HOUR)]})
    [resumed] = (await claim(index, NOW + 1)).claimed
    assert (resumed.member, resumed.nominal_ms) == (BACKFILL, FIRST + HOUR)


async def test_a_backfill_started_while_paused_waits(index: Index) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await index.upsert({0: [Upsert(MEMBER, 2, plan(2), "park", None)]})
    await start(index, 1, 3)
    assert (await claim(index)).claimed == []
    await index.upsert({0: [Upsert(MEMBER, 3, plan(3), "resume", NOW + HOUR)]})
    [taken] = (await claim(index)).claimed
    assert taken.nominal_ms == FIRST


async def test_delete_drops_the_backfill_and_its_occurrence_in_flight(index: Index) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await start(index, 1, 3)
    [taken] = (await claim(index)).claimed
    await index.remove({0: [(MEMBER, 1)]}, now_ms=NOW)
    assert await held(index) is None
    assert await index.position(0, BACKFILL) == (None, None, None)
    assert await complete(index, BACKFILL, taken.token, FIRST + HOUR) == 0


async def test_a_schedule_that_completes_takes_its_backfill_with_it(index: Index) -> None:
    await add(index, 0, MEMBER, NOW - 1)
    await start(index, 1, 3)
    result = await claim(index)
    [taken] = result.claimed
    assert taken.member == BACKFILL
    assert await complete(index, BACKFILL, taken.token, FIRST + HOUR) == 3
    [regular] = (await claim(index, NOW + 300)).claimed
    assert regular.member == MEMBER
    codes = await index.complete(
        {0: [Completion(MEMBER, regular.token, None, "", finish=True)]}, now_ms=NOW
    )
    assert codes[0] == [1]
    assert await held(index) is None
    assert await index.position(0, BACKFILL) == (None, None, None)


async def test_a_backfill_member_without_its_backfill_is_dropped_as_an_orphan(
    index: Index,
) -> None:
    await add(index, 0, MEMBER, NOW + HOUR)
    await index.client.zadd(index.keys.due(0), {BACKFILL: NOW - 1})
    result = await claim(index)
    assert result.claimed == [] and result.orphans == 1
    assert await index.position(0, BACKFILL) == (None, None, None)


async def test_interleaved_claims_completions_and_replacements_never_overlap(
    index: Index,
) -> None:
    """Two dispatchers claiming, executors completing in any order, backfills replaced
    meanwhile: after every step at most one occurrence of the schedule is leased, and every
    backfill occurrence delivered belongs to the generation current when it was claimed."""
    rng = random.Random(7)
    await add(index, 0, MEMBER, NOW)
    generation = 1
    await start(index, generation, 50)
    in_flight: list[Claimed] = []
    now = NOW
    delivered: dict[int, list[int]] = {}
    for _ in range(600):
        now += rng.randint(0, 400)
        step = rng.random()
        if step < 0.45:
            for result in await index.claim([0, 0], 10, LEASE_MS, now_ms=now):
                in_flight += result.claimed
        elif step < 0.9 and in_flight:
            taken = in_flight.pop(rng.randrange(len(in_flight)))
            if taken.member == BACKFILL:
                delivered.setdefault(taken.fires, []).append(taken.nominal_ms)
                following: int | None = taken.nominal_ms + HOUR
            else:
                # The rotation's next time is ahead (a missed one the misfire policy settles).
                following = max(taken.nominal_ms, now) + 1000
            await complete(index, taken.member, taken.token, following, now)
        elif step >= 0.99:
            generation += 1
            await start(index, generation, rng.randint(0, 8), FIRST + generation * HOUR, NOW * 2)
        leased = await index.client.zrange(index.keys.lease(0), 0, -1)
        assert len(leased) <= 1, leased
        assert len(in_flight) <= 1, in_flight
    assert len(delivered) > 3 and sum(len(t) for t in delivered.values()) > 20, delivered
    # Each generation delivered its own times, oldest first, without a gap.
    for gen, times in delivered.items():
        assert times == sorted(times), (gen, times)
        assert all(b - a == HOUR for a, b in itertools.pairwise(times)), (gen, times)


async def run_slow_target(index: Index) -> list[str]:
    """A schedule firing every second whose target takes 1.5 s: its rotation is always behind
    (fire_all: each next time is the previous plus a second, already past). A dispatcher claims
    every 250 ms, the executor completes what it took 1.5 s later. Returns the members
    delivered, in 40 deliveries."""
    await add(index, 0, MEMBER, NOW)
    # Fifty minutes of the past, a minute apart.
    await start(index, 1, 50, to_ms=NOW)
    now, delivered = NOW, list[str]()
    in_flight: list[tuple[int, Claimed]] = []
    while len(delivered) < 40:
        now += 250
        for done_at, taken in list(in_flight):
            if done_at <= now:
                in_flight.remove((done_at, taken))
                following = taken.nominal_ms + (60_000 if taken.member == BACKFILL else 1000)
                assert await complete(index, taken.member, taken.token, following, now) >= 1
        for taken in (await claim(index, now)).claimed:
            delivered.append(taken.member)
            in_flight.append((now + 1500, taken))
        assert len(in_flight) <= 1
    return delivered


async def test_a_rotation_that_is_always_behind_does_not_starve_the_backfill(
    index: Index,
) -> None:
    delivered = await run_slow_target(index)
    turns = "".join("b" if member == BACKFILL else "r" for member in delivered)
    # They take turns: neither waits for the other to drain.
    assert turns.count("b") >= 15, turns
    assert turns.count("r") >= 15, turns


async def test_a_backfill_follows_the_pause_the_index_holds_whatever_its_writer_read(
    index: Index,
) -> None:
    """The intake reads the schedule's state under its row lock, but a pause or resume
    committed just after may reach Redis first: the index's state is the newer one."""
    await add(index, 0, MEMBER, NOW + HOUR)
    # Parked before the backfill's index write arrives: it waits for the resume.
    await index.upsert({0: [Upsert(MEMBER, 2, plan(2), "park", None)]})
    await index.start_backfill(0, BackfillStart(MEMBER, 1, NOW - HOUR, 3, FIRST))
    assert (await claim(index)).claimed == []
    await index.upsert({0: [Upsert(MEMBER, 3, plan(3), "resume", NOW + HOUR)]})
    [taken] = (await claim(index)).claimed
    assert (taken.member, taken.nominal_ms) == (BACKFILL, FIRST)
    # Resumed before a backfill written as paused arrives: it runs.
    await index.upsert({0: [Upsert(MEMBER, 4, plan(4), "park", None)]})
    await index.upsert({0: [Upsert(MEMBER, 5, plan(5), "resume", NOW + HOUR)]})
    await index.start_backfill(0, BackfillStart(MEMBER, 2, NOW - HOUR, 2, FIRST + HOUR))
    assert await complete(index, BACKFILL, taken.token, FIRST + HOUR) == 1
    [new] = (await claim(index, NOW + 1)).claimed
    assert (new.member, new.nominal_ms, new.fires) == (BACKFILL, FIRST + HOUR, 2)


async def test_a_schedule_created_again_waits_for_the_deleted_backfill_delivery(
    index: Index,
) -> None:
    # Deleted while a backfill occurrence is delivered, then created again under the same id:
    # its first occurrence waits for that delivery to end (one schedule, one in flight).
    await add(index, 0, MEMBER, NOW + HOUR)
    await start(index, 1, 3)
    [taken] = (await claim(index)).claimed
    assert taken.member == BACKFILL
    await index.remove({0: [(MEMBER, 1)]}, now_ms=NOW)
    await add(index, 0, MEMBER, NOW + 100, version=2, mode="reset")
    assert (await claim(index, NOW + 800)).claimed == []
    assert await complete(index, BACKFILL, taken.token, FIRST + HOUR) == 0
    [again] = (await claim(index, NOW + 1_200)).claimed
    assert (again.member, again.nominal_ms) == (MEMBER, NOW + 100)
