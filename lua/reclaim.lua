--[[
  reclaim: leases past their deadline go back to `due` (due now) with their token cleared, so
  the message that carried them is stale and the occurrence is published again. The attempt
  number stays: an expired lease does not prove that a delivery was attempted.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  ARGV[1] limit  (count) most leases to reclaim
  ARGV[2] now_ms (ms, optional: '' reads the server clock; tests only)

  Returns {reclaimed, dropped, members...}: dropped counts leases whose schedule is gone.
]]
local due, lease, occ, sched = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local limit = tonumber(ARGV[1])
--!include lib/clock.lua
local now = clock_ms(ARGV[2])
--!include lib/requeue.lua

local expired = redis.call('ZRANGEBYSCORE', lease, '-inf', now, 'LIMIT', 0, limit)
local out = {0, 0}
for _, member in ipairs(expired) do
  local base = string.match(member, '^[^#]*')
  local current = redis.call('HGET', occ, member)
  local nominal, attempt, tail
  if current then
    nominal, attempt, tail = string.match(current, '^(%d+)|(%d+)|%d*|(%d+[|%a]*)$')
  end
  if current and not nominal then
    -- Unreadable state: keep the lease (a minute on) rather than lose the occurrence.
    redis.call('ZADD', lease, now + 60000, member)
  elseif current and redis.call('HEXISTS', sched, base) == 1 then
    requeue(due, lease, occ, member, nominal, attempt, tail, now, false)
    out[1] = out[1] + 1
    out[#out + 1] = member
  else
    redis.call('ZREM', lease, member)
    redis.call('HDEL', occ, member)
    out[2] = out[2] + 1
  end
end
return out
