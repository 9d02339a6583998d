--[[
  park: occurrences held back by a rate key (a Retry-After hold, an open or half-open circuit
  breaker, a rate limit or a quota too far ahead) are parked ONCE until the key can let them
  through, instead of coming due again and again while it stays closed. Each stays in `due`
  (so a pause, a delete, a reset, a rebuild and drift repair see it exactly as before) but at a
  safety deadline `safety_ms` past the key's wake time, with its attempt unchanged and no
  token, flagged catch-up ('c': its misfire policy already let it through; the wait is not
  lateness). It is also listed in the key's parked set of the shard, and the key's wake time
  goes into the shard's registry: the executors release the parked set in bulk when the gate
  can open (unpark.lua). Should no executor release it, the safety deadline brings it back.

  KEYS[1] due     ZSET  member -> fire time (ms)
  KEYS[2] lease   ZSET  member -> lease deadline (ms)
  KEYS[3] occ     HASH  member -> "nominal|attempt|token|fires[|flags]"
  KEYS[4] parked  ZSET  rate key -> wake (ms): when to look at the key's gate again
  KEYS[5] rates   HASH  rate key -> "interval_ms|burst" of its limit ("0|1": none)
  KEYS after those, one per item: its rate key's parked set of the shard,
          pk      ZSET  member -> its safety deadline in `due` (ms)
  ARGV[1] now_ms     (ms, optional: '' reads the server clock; tests only)
  ARGV[2] safety_ms  (ms) how long past its wake a parked occurrence comes due by itself
  ARGV quintuples from ARGV[3], one per item: member, token, rate key, wake_ms (absolute),
    limit ("interval_ms|burst")

  Returns one code per item: 1 parked, 0 stale (token no longer current).
]]
local due, lease, occ, parked, rates = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
--!include lib/clock.lua
local now = clock_ms(ARGV[1])
local safety = tonumber(ARGV[2])

--!include lib/revoked.lua

local results = {}
local item = 0
for i = 3, #ARGV, 5 do
  item = item + 1
  local member, token, rate_key = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local wake, limit = tonumber(ARGV[i + 3]), ARGV[i + 4]
  local current = redis.call('HGET', occ, member)
  local nominal, attempt, current_token, tail
  if current then
    nominal, attempt, current_token, tail =
      string.match(current, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  end
  if current_token == token and token ~= '' then
    local fires, flags = string.match(tail, '^([^|]*)|?(.*)$')
    if not string.find(flags, 'c', 1, true) then
      flags = flags .. 'c'
    end
    local deadline = math.max(wake, now) + safety
    redis.call('ZREM', lease, member)
    redis.call('HSET', occ, member, nominal .. '|' .. attempt .. '||' .. fires .. '|' .. flags)
    redis.call('ZADD', due, deadline, member)
    redis.call('ZADD', KEYS[5 + item], deadline, member)
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
