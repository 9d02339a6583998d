"""Review of the policies change, at the level of the Lua scripts: a rolling upgrade (a
dispatcher of the previous version claims what new executors wrote), and the same version
written twice (drift repair and the intake)."""

from __future__ import annotations

from shared import compact
from shared.index import Index, Upsert
from shared.plan import IntervalRule, Plan, WebhookPlan

NOW = 1_800_000_000_000

#: claim.lua as the previous version (234e95e) ships it, header left out.
PREVIOUS_CLAIM = """
local due, lease, occ, sched, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local limit = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])

local now
if ARGV[3] and ARGV[3] ~= '' then
  now = tonumber(ARGV[3])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local items = redis.call('ZRANGEBYSCORE', due, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
local out = {now, -1, 0}
local count = #items / 2
if count > 0 then
  local token = redis.call('INCRBY', seq, count) - count
  local deadline = now + lease_ms
  local orphans = 0
  for i = 1, #items, 2 do
    local member, fire = items[i], items[i + 1]
    redis.call('ZREM', due, member)
    local base = string.match(member, '^[^#]*')
    local plan = redis.call('HGET', sched, base)
    if not plan then
      redis.call('HDEL', occ, member)
      orphans = orphans + 1
    else
      token = token + 1
      local nominal, attempt, fires = fire, '1', '0'
      local current = redis.call('HGET', occ, member)
      if current then
        nominal, attempt, fires = string.match(current, '^([^|]*)|([^|]*)|[^|]*|([^|]*)$')
      end
      redis.call('HSET', occ, member, nominal .. '|' .. attempt .. '|' .. token .. '|' .. fires)
      redis.call('ZADD', lease, deadline, member)
      out[#out + 1] = member
      out[#out + 1] = fire
      out[#out + 1] = nominal
      out[#out + 1] = attempt
      out[#out + 1] = token
      out[#out + 1] = fires
      out[#out + 1] = plan
    end
  end
  out[3] = orphans
end

local first = redis.call('ZRANGE', due, 0, 0, 'WITHSCORES')
if first[2] then
  out[2] = tonumber(first[2])
end
return out
"""


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
