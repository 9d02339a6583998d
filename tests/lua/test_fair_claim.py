"""claim.lua shares a contended claim fairly between namespaces (real Redis)."""

from __future__ import annotations

from shared.redis.index import Index
from tests.lua.test_scripts import LEASE_MS, NOW, plan


async def fill(index: Index, namespace: str, count: int, score: int, shard: int = 0) -> None:
    members = {f"{namespace}/s{i:06d}": score for i in range(count)}
    await index.client.zadd(index.keys.due(shard), members)
    await index.client.hset(index.keys.sched(shard), mapping=dict.fromkeys(members, plan()))


async def claim_namespaces(index: Index, limit: int) -> list[str]:
    result = (await index.claim([0], limit, LEASE_MS, now_ms=NOW))[0]
    return [c.member.partition("/")[0] for c in result.claimed]


async def test_a_small_namespace_is_not_stuck_behind_a_herd(index: Index) -> None:
    await fill(index, "a", 3000, NOW - 10)
    await fill(index, "b", 5, NOW - 10)
    await fill(index, "c", 40, NOW - 5)
    claimed = await claim_namespaces(index, 100)
    assert len(claimed) == 100
    assert claimed.count("b") == 5 and claimed.count("c") == 40
    assert claimed.count("a") == 55
    # The rest drains in later claims, nothing lost.
    total = 100
    while True:
        more = await claim_namespaces(index, 500)
        if not more:
            break
        total += len(more)
    assert total == 3045


async def test_shares_are_equal_when_every_namespace_has_enough(index: Index) -> None:
    for namespace in ("x", "y", "z"):
        await fill(index, namespace, 1000, NOW - 1)
    claimed = await claim_namespaces(index, 300)
    assert [claimed.count(n) for n in ("x", "y", "z")] == [100, 100, 100]


async def test_one_namespace_claims_in_due_order(index: Index) -> None:
    client = index.client
    members = {f"a/s{i:04d}": NOW - 1000 + (i % 7) for i in range(200)}
    await client.zadd(index.keys.due(0), members)
    await client.hset(index.keys.sched(0), mapping=dict.fromkeys(members, plan()))
    result = (await index.claim([0], 50, LEASE_MS, now_ms=NOW))[0]
    expected = sorted(members, key=lambda m: (members[m], m))[:50]
    assert [c.member for c in result.claimed] == expected


async def test_without_contention_nothing_changes(index: Index) -> None:
    await fill(index, "a", 10, NOW - 10)
    await fill(index, "b", 10, NOW - 20)
    result = (await index.claim([0], 100, LEASE_MS, now_ms=NOW))[0]
    assert [c.member for c in result.claimed][:10] == [f"b/s{i:06d}" for i in range(10)]
    assert len(result.claimed) == 20
