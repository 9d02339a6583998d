"""Review of the policies change, at the level of the Lua scripts: a rolling upgrade (a
dispatcher of the previous version claims what new executors wrote), and the same version
written twice (drift repair and the intake)."""

from __future__ import annotations

from shared.contract.entries import Upsert
from shared.redis.index import Index
from shared.rules import compact
from shared.rules.plan import IntervalRule, Plan, WebhookPlan

NOW = 1_800_000_000_000


#: claim.lua as the previous version (234e95e) ships it, header left out.
async def test_the_same_reset_written_twice_does_not_revoke_the_occurrence_in_flight(
    index: Index,
) -> None:
    """Drift repair and the intake both write a reset of version 2 (the sweeper read the
    committed row before the intake's own index write landed). The second write of the same
    version must not revoke the occurrence the first one placed and a dispatcher claimed:
    that occurrence would be placed again and delivered twice, overlapping (invariant 3)."""
    shard, member = 0, "ns/s"
    v1 = Plan(version=1, rule=IntervalRule(60_000), target=WebhookPlan("http://sink/x"))
    v2 = Plan(version=2, rule=IntervalRule(30_000), target=WebhookPlan("http://sink/x"))
    await index.upsert({shard: [Upsert(member, 1, compact.encode(v1), "keep", NOW, "")]})
    reset = Upsert(member, 2, compact.encode(v2), "reset", NOW + 30_000, "")
    assert await index.upsert({shard: [reset]}) == {shard: [1]}  # drift repair's write
    [result] = await index.claim([shard], 10, 30_000, NOW + 30_000)
    [claimed] = result.claimed
    await index.upsert({shard: [reset]})  # the intake's, a bit later
    _, codes = await index.begin({shard: [(member, claimed.token, 10_000)]}, NOW + 30_001)
    assert codes == {shard: [1]}, "the in-flight occurrence was revoked and placed again"
