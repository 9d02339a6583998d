--[[
  park: occurrences held back by a rate key (a Retry-After hold, an open or half-open circuit
  breaker, a rate limit or a quota too far ahead) are parked ONCE until the key can let them
  through, instead of coming due again and again while it stays closed. Each stays in `due`
  (so a pause, a delete, a reset, a rebuild and drift repair see it exactly as before) but at a
  safety deadline `safety_ms` past the key's wake time, with its attempt unchanged and no
  token, flagged catch-up ('c': its misfire policy already let it through; the wait is not
  lateness). It is also listed in the key's parked set of the shard and marked parked (its
  deadline in `pkm`, so that a write of its schedule releases it: upsert.lua), and the key's
  wake time goes into the shard's registry: the executors release the parked set in bulk when
  the gate can open (unpark.lua). Should no executor release it, the safety deadline brings it
  back; each item's `safety_ms` differs a little (shared.policy.holds.safety_ms_of), so what
  was parked together does not come back in the same millisecond.

  An occurrence whose schedule was written since it was claimed (its stored version is not
  the one the executor holds) is not parked: it comes due now, so that it is judged by its
  new target (a write made while it was in flight found nothing parked to release: upsert.lua).

  KEYS[1] due     ZSET  member -> fire time (ms)
  KEYS[2] lease   ZSET  member -> lease deadline (ms)
  KEYS[3] occ     HASH  member -> "nominal|attempt|token|fires[|flags]"
  KEYS[4] parked  ZSET  rate key -> wake (ms): when to look at the key's gate again
  KEYS[5] rates   HASH  rate key -> "interval_ms|burst" of its limit ("0|1": none)
  KEYS[6] pkm     HASH  member -> its parked deadline in `due` (ms)
  KEYS[7] sched   HASH  ns/id  -> compact schedule (starts with its version:
                        lib/plan_version.lua)
  KEYS after those, one per item: its rate key's parked set of the shard,
          pk      ZSET  member -> its safety deadline in `due` (ms)
  ARGV[1] now_ms     (ms, optional: '' reads the server clock; tests only)
  ARGV septuples from ARGV[2], one per item: member, token, rate key, wake_ms (absolute),
    limit ("interval_ms|burst"), safety_ms (how long past its wake it comes due by itself),
    version (of the schedule the executor holds; '': not checked)

  Returns one code per item: 1 parked, 0 stale (token no longer current), 2 due now (its
  schedule was written since its claim).
]]
local due, lease, occ, parked, rates, pkm = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local sched = KEYS[7]
--!include lib/clock.lua
--!include lib/plan_version.lua
local now = clock_ms(ARGV[1])

--!include lib/revoked.lua
--!include lib/requeue.lua

-- Whether the schedule of `member` (its base `ns/id`: a backfill's or a trigger's too) was
-- written since the executor read it at `version`.
local function rewritten(member, version)
  if version == '' then
    return false
  end
  local stored = redis.call('HGET', sched, string.match(member, '^[^#]*'))
  local stored_version = plan_version(stored)
  return stored_version ~= nil and stored_version ~= tonumber(version)
end

local results = {}
local item = 0
for i = 2, #ARGV, 7 do
  item = item + 1
  local member, token, rate_key = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local wake, limit, safety = tonumber(ARGV[i + 3]), ARGV[i + 4], tonumber(ARGV[i + 5])
  local version = ARGV[i + 6]
  local nominal, attempt, current_token, tail = occ_fields(redis.call('HGET', occ, member))
  if current_token == token and token ~= '' and rewritten(member, version) then
    requeue(due, lease, occ, member, nominal, attempt, tail, now, true)
    results[#results + 1] = 2
  elseif current_token == token and token ~= '' then
    local deadline = math.max(wake, now) + safety
    requeue(due, lease, occ, member, nominal, attempt, tail, deadline, true)
    redis.call('HSET', pkm, member, deadline)
    redis.call('ZADD', KEYS[7 + item], deadline, member)
    -- The earliest wake wins: a later hold of the same key is looked at then anyway.
    redis.call('ZADD', parked, 'LT', wake, rate_key)
    redis.call('HSET', rates, rate_key, limit)
    results[#results + 1] = 1
  else
    free_revoked(occ, member, token)
    results[#results + 1] = 0
  end
end
return results
