"""Probes go round the schedules parked behind a rate key, with fixed clocks against the real
Redis: a schedule whose probe fails is parked again behind the key and must not take the
next probe while other schedules wait there (issue 34, probe fairness).

Each round is what the executors do: at the end of the cooldown a look releases the
half-open breaker's probe (``Parking.look``); it is claimed, let through by the gate as the
probe, fails (``report.lua`` opens the breaker again), comes back and is parked again behind
the key until the new cooldown ends; the look ``PROBE_LOOK_MS`` later moves the key's wake to
that end. The parked order is each occurrence's safety deadline: its wake plus a fixed offset
by a hash of its member, up to a tenth of ``CRONBUS_PARK_SAFETY_S`` either way (90 s at the
default), so a member whose offset is lowest stays first for several cooldowns even though it
was parked again a cooldown later than the others."""

from __future__ import annotations

import asyncio

from services.executor.parking import Parking
from shared.policy import holds
from shared.policy.holds import safety_ms_of
from shared.redis import holds as parked
from shared.redis.holds import ToPark, ToRelease
from shared.redis.index import Index
from tests.lua.test_parking import KEY, LIMIT, SAFETY, claimed_token
from tests.lua.test_scripts import LEASE_MS, NOW

THRESHOLD = 3
COOLDOWN_MS = 30_000
PROBE_MS = 15_000


def by_safety_offset(count: int) -> list[str]:
    """Members of schedules ordered by their safety offset, the lowest first, spread over
    the whole range: the first is parked ahead of the others by more than a cooldown."""
    candidates = sorted((f"acme/s{i}" for i in range(400)), key=lambda m: safety_ms_of(m, SAFETY))
    chosen = [candidates[0], *candidates[-(count - 1) :]]
    gap = safety_ms_of(chosen[1], SAFETY) - safety_ms_of(chosen[0], SAFETY)
    assert gap > 4 * COOLDOWN_MS, gap
    return chosen


async def open_breaker(index: Index, now: int) -> int:
    """THRESHOLD failed attempts: the breaker opens; returns the end of its cooldown."""
    codes = await index.report([(KEY, 0, None)] * THRESHOLD, THRESHOLD, COOLDOWN_MS, 60_000, now)
    assert codes[-1] == 2
    return now + COOLDOWN_MS


async def park_all(index: Index, members: dict[str, int], wake: int, now: int) -> None:
    """Each member (-> its shard) claimed and parked behind the open breaker."""
    for member, shard in members.items():
        token = await claimed_token(index, shard, member, now)
        item = ToPark(member, token, KEY, wake, LIMIT)
        assert (await parked.park(index, {shard: [item]}, SAFETY, now_ms=now))[shard] == [1]


async def released_at(index: Index, shards: set[int], now: int) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for shard in sorted(shards):
        for member in await index.client.zrangebyscore(index.keys.due(shard), now, now):
            found.append((shard, member.decode() if isinstance(member, bytes) else str(member)))
    return found


async def failed_probe_round(
    index: Index, parking: Parking, members: dict[str, int], now: int
) -> tuple[str, int]:
    """The breaker is half-open at ``now``: one look releases the probe, which fails and is
    parked again; returns the probe's member and the end of the new cooldown."""
    assert await parking.look(now_ms=now) == 1
    [(shard, member)] = await released_at(index, set(members.values()), now)
    [result] = await index.claim([shard], 10, LEASE_MS, now_ms=now)
    [claimed] = result.claimed
    [(code, _, flags)] = await index.gate([(KEY, 0.0, 1, PROBE_MS)], THRESHOLD, 2000, now)
    assert code == 0 and flags & 1, "the released occurrence is the probe"
    assert await index.report([(KEY, 0, None)], THRESHOLD, COOLDOWN_MS, 60_000, now + 5) == [2]
    open_until = now + 5 + COOLDOWN_MS
    # Its retry comes due within the cooldown, is held and parked again until its end.
    item = ToPark(member, claimed.token, KEY, open_until, LIMIT)
    assert (await parked.park(index, {shard: [item]}, SAFETY, now_ms=now + 500))[shard] == [1]
    # The look after PROBE_LOOK_MS finds the breaker open again: the wake moves to its end.
    assert await parking.look(now_ms=now + holds.PROBE_LOOK_MS) == 0
    return member, open_until


def parking_of(index: Index) -> Parking:
    return Parking(index, asyncio.Event(), THRESHOLD, window_ms=2000, flush_ms=1)


async def test_probes_go_round_the_schedules_of_the_key(index: Index) -> None:
    members = dict.fromkeys(by_safety_offset(10), 0)
    first = next(iter(members))
    open_until = await open_breaker(index, NOW)
    await park_all(index, members, open_until, NOW + 10)
    parking = parking_of(index)
    probes = []
    for _ in range(len(members) + 2):
        member, open_until = await failed_probe_round(index, parking, members, open_until)
        probes.append(member)
    # The first parked goes first; once it failed, each of the others has its turn before
    # it comes again (today's order gave the first every probe for five cooldowns).
    assert probes[0] == first
    assert sorted(probes[: len(members)]) == sorted(members), probes
    # Then round again, the one whose turn is the oldest first.
    assert probes[len(members) :] == probes[:2], probes


async def test_probes_go_round_the_shards_that_park_the_key(index: Index) -> None:
    # The failing schedule alone in one shard, the healthy ones in another: successive probes
    # come from each shard in turn, whichever look releases them (today two looks a round
    # moved the executor's turn by two: the same shard gave every probe).
    failing, *healthy = by_safety_offset(4)
    members = {failing: 0, **dict.fromkeys(healthy, 1)}
    open_until = await open_breaker(index, NOW)
    await park_all(index, members, open_until, NOW + 10)
    parking = parking_of(index)
    probes = []
    for _ in range(6):
        member, open_until = await failed_probe_round(index, parking, members, open_until)
        probes.append(member)
    assert [members[m] for m in probes] == [0, 1, 0, 1, 0, 1], probes
    assert sorted(probes[1::2]) == sorted(healthy), probes


async def test_a_member_gone_while_parked_is_dropped_and_the_turns_go_on(
    index: Index,
) -> None:
    a, b, c = by_safety_offset(3)
    members = dict.fromkeys((a, b, c), 0)
    open_until = await open_breaker(index, NOW)
    await park_all(index, members, open_until, NOW + 10)
    parking = parking_of(index)
    first, open_until = await failed_probe_round(index, parking, members, open_until)
    assert first == a
    await index.remove({0: [(b, None)]}, now_ms=open_until)  # deleted while parked
    second, open_until = await failed_probe_round(index, parking, members, open_until)
    assert second == c
    assert await parked.parked_count(index, 0, KEY) == 2  # a, c; b dropped, never released


async def test_the_turns_go_with_the_last_parked_member(index: Index) -> None:
    members = dict.fromkeys(by_safety_offset(2), 0)
    open_until = await open_breaker(index, NOW)
    await park_all(index, members, open_until, NOW + 10)
    parking = parking_of(index)
    _, open_until = await failed_probe_round(index, parking, members, open_until)
    turns_key = index.keys.probed(0, KEY)
    assert await index.client.zcard(turns_key) == 1
    assert await index.client.pttl(turns_key) > 0
    # The breaker closes: the rest is released in chunks, and the turns go with the set.
    _, _, breaker = index.keys.rate(KEY)
    await index.client.delete(breaker)
    [seen] = (await parked.wakes(index, 10, now_ms=open_until))[1]
    release = ToRelease(KEY, seen.wake_ms, holds.CHUNK, open_until + 250)
    assert await parked.unpark(index, {0: [release]}, 0, now_ms=open_until) == {0: [(2, 0)]}
    assert not await index.client.exists(turns_key)


async def test_a_release_that_is_not_a_probe_keeps_the_parked_order(index: Index) -> None:
    # A limited key's slots (count 1 too) are the oldest parked, whatever the probes' turns.
    a, b = by_safety_offset(2)
    members = dict.fromkeys((a, b), 0)
    await park_all(index, members, NOW + 1000, NOW)
    await index.client.zadd(index.keys.probed(0, KEY), {a: 1})
    release = ToRelease(KEY, NOW + 1000, 1, NOW + 3000)
    assert await parked.unpark(index, {0: [release]}, 0, now_ms=NOW + 1000) == {0: [(1, 1)]}
    assert await released_at(index, {0}, NOW + 1000) == [(0, a)]


async def test_turns_are_the_schedules_not_their_occurrences(index: Index) -> None:
    # A schedule's backfill occurrence (``ns/id#b``) shares its schedule's turn: once the
    # schedule was the probe, another schedule's occurrence is the next one.
    client, deadline = index.client, NOW + SAFETY
    for i, member in enumerate(("acme/a", "acme/a#b", "acme/c")):
        await client.zadd(index.keys.parked_on(0, KEY), {member: deadline + i})
        await client.zadd(index.keys.due(0), {member: deadline + i})
        await client.hset(index.keys.occ(0), member, f"{NOW}|1||0|c")
    await client.zadd(index.keys.parked(0), {KEY: NOW})
    await client.zadd(index.keys.probed(0, KEY), {"acme/a": 1})
    probe = ToRelease(KEY, NOW, 1, NOW + holds.PROBE_LOOK_MS, probe=True)
    assert await parked.unpark(index, {0: [probe]}, 0, now_ms=NOW) == {0: [(1, 2)]}
    assert await released_at(index, {0}, NOW) == [(0, "acme/c")]
