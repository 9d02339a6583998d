"""gate.lua, report.lua and park.lua against the real Redis: GCRA slots, Retry-After holds,
circuit breakers, holds that keep the attempt."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from services.executor.limits import HELD, Admission, Limits
from services.executor.settle import Outcome
from shared.contract.delivery import Occurrence
from shared.contract.entries import occ_state
from shared.policy.holds import safety_ms_of
from shared.policy.limits import rate_key
from shared.redis import holds
from shared.redis.holds import ToPark, ToRelease
from shared.redis.index import Index
from shared.rules.plan import WebhookPlan
from shared.runtime.config import ExecutorSettings
from tests.lua.test_scripts import LEASE_MS, NOW, add

KEY = "acme|http://127.0.0.1:80"
FAILS = 3


async def gate(
    index: Index, now: int, *items: tuple[str, float, int, int]
) -> list[tuple[int, int, int]]:
    return await index.gate(list(items), FAILS, 2000, now_ms=now)


async def test_gcra_admits_the_burst_then_reserves_slots_then_holds(index: Index) -> None:
    limited = (KEY, 200.0, 2, 10_000)  # 5 per second, burst 2
    results = await gate(index, NOW, *[limited] * 14)
    codes = [code for code, _, _ in results]
    assert codes[:2] == [0, 0]
    waits = [ms for code, ms, _ in results if code == 1]
    assert waits == [200 * n for n in range(1, len(waits) + 1)]
    assert max(waits) <= 2000
    held = [ms for code, ms, _ in results if code == 2]
    assert held and all(until > NOW for until in held)
    # Later, the slots have been used up by time: the burst is available again.
    again = await gate(index, NOW + 60_000, limited, limited)
    assert [code for code, _, _ in again] == [0, 0]


async def test_an_unlimited_key_always_goes(index: Index) -> None:
    results = await gate(index, NOW, *[(KEY, 0.0, 1, 10_000)] * 50)
    assert {code for code, _, _ in results} == {0}


async def test_retry_after_holds_the_key_until_then(index: Index) -> None:
    assert await index.report([(KEY, False, 3000)], FAILS, 30_000, 60_000, now_ms=NOW) == [0]
    ((code, until, _),) = await gate(index, NOW + 1000, (KEY, 0.0, 1, 10_000))
    assert (code, until) == (2, NOW + 3000)
    other = await gate(index, NOW + 1000, ("other|http://127.0.0.1:80", 0.0, 1, 10_000))
    assert other[0][0] == 0


async def test_breaker_opens_after_consecutive_failures_then_lets_one_probe(index: Index) -> None:
    codes = await index.report([(KEY, False, None)] * FAILS, FAILS, 30_000, 60_000, now_ms=NOW)
    assert codes == [0, 0, 2]
    ((code, until, _),) = await gate(index, NOW + 1000, (KEY, 0.0, 1, 10_000))
    assert (code, until) == (2, NOW + 30_000)
    after = NOW + 30_001
    results = await gate(index, after, (KEY, 0.0, 1, 10_000), (KEY, 0.0, 1, 10_000))
    assert results[0][0] == 0 and results[0][2] & 1  # the probe
    assert results[1][:2] == (2, after + 10_000)  # the others wait for it
    # The probe failed: open again.
    assert await index.report([(KEY, False, None)], FAILS, 30_000, 60_000, now_ms=after + 50) == [2]
    ((code, until, _),) = await gate(index, after + 100, (KEY, 0.0, 1, 10_000))
    assert (code, until) == (2, after + 50 + 30_000)


async def test_a_success_closes_the_breaker_and_resets_the_count(index: Index) -> None:
    await index.report([(KEY, False, None)] * FAILS, FAILS, 30_000, 60_000, now_ms=NOW)
    ((_, _, flags),) = await gate(index, NOW + 30_001, (KEY, 0.0, 1, 10_000))
    assert flags == 3  # probe, and the breaker counts failures
    assert await index.report([(KEY, True, None)], FAILS, 30_000, 60_000, now_ms=NOW + 30_100) == [
        1
    ]
    assert await index.breaker_state(KEY) == (0, 0, 0, 0)
    codes = await index.report(
        [(KEY, False, None)] * (FAILS - 1), FAILS, 30_000, 60_000, now_ms=NOW
    )
    assert codes == [0, 0]


async def test_park_keeps_the_attempt_drops_the_token_and_flags_a_catch_up(
    index: Index,
) -> None:
    await add(index, 0, "ns/a", NOW)
    claimed = (await index.claim([0], 10, LEASE_MS, now_ms=NOW))[0].claimed[0]
    await index.client.hset(index.keys.occ(0), "ns/a", occ_state(NOW, 2, claimed.token, 0))
    held = ToPark("ns/a", claimed.token, KEY, NOW + 5000, "0.000|1")
    assert await holds.park(index, {0: [held]}, 1000, now_ms=NOW) == {0: [1]}
    due, lease, occ = await index.position(0, "ns/a")
    assert (lease, occ) == (None, occ_state(NOW, 2, "", 0, "c"))
    assert due == NOW + 5000 + safety_ms_of("ns/a", 1000)
    assert await holds.park(index, {0: [held]}, 1000, now_ms=NOW) == {0: [0]}
    await holds.unpark(
        index, {0: [ToRelease(KEY, NOW + 5000, 1, NOW + 6000)]}, 0, now_ms=NOW + 5000
    )
    again = (await index.claim([0], 10, LEASE_MS, now_ms=NOW + 5000))[0].claimed[0]
    assert (again.nominal_ms, again.attempt, again.catch_up) == (NOW, 2, True)


async def test_a_probe_that_sent_nothing_gives_its_slot_back(index: Index) -> None:
    """A probe refused before anything was sent (a missing secret, the operator's policy)
    says nothing of the host: the breaker stays as it was, and the next delivery is the
    probe at once, not after the probe's timeout."""
    await index.report([(KEY, False, None)] * FAILS, FAILS, 30_000, 60_000, now_ms=NOW)
    after = NOW + 30_001
    ((code, _, flags),) = await gate(index, after, (KEY, 0.0, 1, 10_000))
    assert code == 0 and flags & 1
    no_news = [(KEY, 2, None)]
    assert await index.report(no_news, FAILS, 30_000, 60_000, now_ms=after + 50) == [0]
    ((code, _, flags),) = await gate(index, after + 100, (KEY, 0.0, 1, 10_000))
    assert code == 0 and flags & 1  # the next probe, at once
    fails, open_until, _, _ = await index.breaker_state(KEY)
    assert (fails, open_until) == (FAILS, NOW + 30_000)


async def test_the_executor_gives_back_a_probe_that_sent_nothing(
    index: Index, redis_prefix: str
) -> None:
    """The executor's side: a probe whose delivery was refused before sending (here a
    missing secret) frees the probe slot instead of holding the breaker's key for the
    probe's timeout."""
    settings = ExecutorSettings(redis_prefix=redis_prefix, shards=index.shards)
    limits = Limits(index, settings, asyncio.Event(), lambda: int(time.time() * 1000), 1)
    key = "acme|http://127.0.0.1:80"
    failures = settings.breaker_failures
    await index.report([(key, False, None)] * failures, failures, 1, 60_000)
    await asyncio.sleep(0.01)  # past the 1 ms cooldown: half-open
    ((code, _, flags),) = await index.gate([(key, 0.0, 1, 60_000)], failures, 2000)
    assert code == 0 and flags & 1
    probe = Admission(key, code, 0, True, True)
    nothing_sent = Outcome(False, None, "secret missing", sent=False)
    await limits.report(cast(Occurrence, SimpleNamespace(namespace="acme")), probe, nothing_sent)
    ((code, _, flags),) = await index.gate([(key, 0.0, 1, 60_000)], failures, 2000)
    assert code == 0 and flags & 1, "the next delivery is the probe, at once"
    await limits.drain()


async def test_a_probe_the_quota_holds_gives_its_slot_back(
    index: Index, redis_prefix: str, tmp_path: Path
) -> None:
    """The target's gate gives the half-open breaker's probe to a delivery its namespace's
    max_fires_per_s then holds: it is parked behind the quota, and the probe slot is free for
    the next delivery of the key at once, not after the probe's timeout."""
    quotas = tmp_path / "quotas.json"
    quotas.write_text('{"acme": {"max_fires_per_s": 0.01}}')
    settings = ExecutorSettings(
        redis_prefix=redis_prefix, shards=index.shards, quotas_file=str(quotas)
    )
    limits = Limits(index, settings, asyncio.Event(), lambda: int(time.time() * 1000), 1)
    target = WebhookPlan("http://127.0.0.1:80/a")
    key = rate_key("acme", target)
    occ = cast(Occurrence, SimpleNamespace(namespace="acme", plan=SimpleNamespace(target=target)))
    other = WebhookPlan("http://127.0.0.1:81/b")
    first = cast(Occurrence, SimpleNamespace(namespace="acme", plan=SimpleNamespace(target=other)))
    assert (await limits.admit(first)).code == 0  # the quota's one fire for the next 100 s
    failures = settings.breaker_failures
    await index.report([(key, False, None)] * failures, failures, 1, 60_000)
    await asyncio.sleep(0.01)  # past the 1 ms cooldown: half-open
    held = await limits.admit(occ)
    assert held.code == HELD and not held.probe
    ((code, _, flags),) = await index.gate([(key, 0.0, 1, 60_000)], failures, 2000)
    assert code == 0 and flags & 1, "the next delivery is the probe, at once"
    await limits.drain()
