--[[
  claim: take up to `limit` occurrences that are due by now out of `due`, lease them with a
  deadline and a fresh fencing token, and return them with their schedules.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires" (absent: nominal = fire, 1, -, 0)
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  KEYS[5] seq    STRING fencing token counter
  ARGV[1] limit     (count) most occurrences to claim
  ARGV[2] lease_ms  (ms) how long the claim holds before the sweeper may reclaim it
  ARGV[3] now_ms    (ms, optional) overrides the server clock; tests only

  Returns {now_ms, next_due_ms (-1: none left), orphans, claimed...} where claimed is
  7 values per occurrence: member, fire_ms, nominal_ms, attempt, token, fires, schedule.
  An orphan is a due member whose schedule is gone (deleted meanwhile): it is dropped.
]]
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
