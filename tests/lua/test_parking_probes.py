"""The parking race with fixed clocks, against the real Redis: a park that goes through the
batcher after its breaker closed (the close's release found nothing parked yet) must not wait
for the wake of the probe deadline it was held by; and a look that read a gate before a nudge
is fenced off rather than moving the wake back to a hold that is gone."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

from services.executor.parking import Parking
from shared.contract.delivery import Occurrence
from shared.policy.holds import SPREAD_MS
from shared.redis import holds
from shared.redis.holds import ToRelease
from shared.redis.index import Index
from tests.lua.test_parking import KEY, LIMIT, claimed_token, park
from tests.lua.test_scripts import NOW

THRESHOLD = 5


async def server_ms(index: Index) -> int:
    seconds, micros = await index.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def held(shard: int, member: str, token: int) -> Occurrence:
    """What ``Parking.park`` reads of an occurrence (its schedule's version not checked)."""
    plan = SimpleNamespace(version=None)
    return cast(Occurrence, SimpleNamespace(shard=shard, member=member, token=token, plan=plan))


async def test_a_park_landing_after_the_close_is_looked_at_now_not_at_the_probe_deadline(
    index: Index,
) -> None:
    now = await server_ms(index)
    probe_deadline = now + 30_000
    token = await claimed_token(index, 0, "ns/a", now)
    # The breaker was half-open with its probe in flight when the gate held the occurrence;
    # the probe succeeded and the breaker closed (its release found nothing parked) before
    # the park, still in the batcher, landed with the probe's deadline for its wake.
    _, _, breaker = index.keys.rate(KEY)
    await index.client.delete(breaker)
    parking = Parking(index, asyncio.Event(), THRESHOLD, window_ms=1000, flush_ms=5)
    assert await parking.park(held(0, "ns/a", token), KEY, probe_deadline, LIMIT) == 1
    woken = (await holds.wakes(index, 10, now_ms=now + 1))[1]
    assert [w.rate_key for w in woken] == [KEY], "the park waits for a breaker already closed"
    assert await parking.look() == 1
    fire = (await index.position(0, "ns/a"))[0]
    assert fire is not None and fire <= await server_ms(index) + SPREAD_MS


async def test_a_park_while_the_probe_is_in_flight_keeps_its_wake(index: Index) -> None:
    now = await server_ms(index)
    probe_deadline = now + 30_000
    token = await claimed_token(index, 0, "ns/a", now)
    _, _, breaker = index.keys.rate(KEY)
    await index.client.hset(
        breaker, mapping={"fails": THRESHOLD, "open_until": 0, "probe_until": probe_deadline}
    )
    parking = Parking(index, asyncio.Event(), THRESHOLD, window_ms=1000, flush_ms=5)
    assert await parking.park(held(0, "ns/a", token), KEY, probe_deadline, LIMIT) == 1
    assert (await holds.wakes(index, 10, now_ms=probe_deadline - 1))[1] == []


async def test_a_look_that_read_the_gate_before_a_nudge_is_fenced_off(index: Index) -> None:
    await park(index, "ns/a", await claimed_token(index, 0, "ns/a", NOW), NOW + 30_000)
    await holds.nudge(index, [KEY])
    # A look reads wake 0 and the gate (still open); the breaker closes and nudges again;
    # the look's release, decided from the open gate, must change nothing.
    [seen] = (await holds.wakes(index, 10, now_ms=NOW))[1]
    await holds.nudge(index, [KEY])
    stale = ToRelease(KEY, seen.wake_ms, 0, NOW + 30_000)
    assert await holds.unpark(index, {0: [stale]}, 0, now_ms=NOW) == {0: [(-1, 1)]}
    [after] = (await holds.wakes(index, 10, now_ms=NOW))[1]
    assert after.wake_ms < seen.wake_ms <= 0
