--[[
  defer: occurrences held back by a rate key (a Retry-After hold, an open circuit breaker, or a
  rate limit too far ahead) go back into `due` at the hold's end with their attempt unchanged
  and no token, so they neither burn an attempt nor hold a lease or an executor meanwhile. A
  marker remembers that the occurrence was already admitted by its misfire policy: it is
  delivered late, not judged (and dropped) again.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires"
  then one marker STRING per quadruple (from KEYS[4] on): the deferred occurrence's nominal
  ARGV[1] marker_ttl_ms (ms) how long a marker outlives the deferral
  ARGV[2..] quadruples: member, token, at_ms (ms, absolute), nominal_ms

  Returns one code per quadruple: 1 deferred, 0 stale (token no longer current).
]]
local due, lease, occ = KEYS[1], KEYS[2], KEYS[3]
local marker_ttl = tonumber(ARGV[1])

local results = {}
local n = 0
for i = 2, #ARGV, 4 do
  n = n + 1
  local member, token, at, nominal = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  local current = redis.call('HGET', occ, member)
  local current_nominal, attempt, current_token, fires
  if current then
    current_nominal, attempt, current_token, fires =
      string.match(current, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  end
  if current_token == token then
    redis.call('ZREM', lease, member)
    redis.call('HSET', occ, member, current_nominal .. '|' .. attempt .. '||' .. fires)
    redis.call('ZADD', due, at, member)
    redis.call('SET', KEYS[3 + n], nominal, 'PX', marker_ttl)
    results[#results + 1] = 1
  else
    results[#results + 1] = 0
  end
end
return results
