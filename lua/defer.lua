--[[
  defer: occurrences held back by a rate key (a Retry-After hold, an open circuit breaker, a
  rate limit or a quota too far ahead) go back into `due` at the hold's end with their attempt
  unchanged and no token, so they neither burn an attempt nor hold a lease, an executor slot or
  a message meanwhile. They are flagged catch-up ('c'): their misfire policy already let them
  through, so they are delivered late, not judged (and perhaps dropped) again.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
  ARGV triples: member, token, at_ms (ms, absolute)

  Returns one code per triple: 1 deferred, 0 stale (token no longer current).
]]
local due, lease, occ = KEYS[1], KEYS[2], KEYS[3]

--!include lib/revoked.lua

local results = {}
for i = 1, #ARGV, 3 do
  local member, token, at = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local current = redis.call('HGET', occ, member)
  local nominal, attempt, current_token, tail
  if current then
    nominal, attempt, current_token, tail =
      string.match(current, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  end
  if current_token == token then
    local fires, flags = string.match(tail, '^([^|]*)|?(.*)$')
    if not string.find(flags, 'c', 1, true) then
      flags = flags .. 'c'
    end
    redis.call('ZREM', lease, member)
    redis.call('HSET', occ, member, nominal .. '|' .. attempt .. '||' .. fires .. '|' .. flags)
    redis.call('ZADD', due, at, member)
    results[#results + 1] = 1
  else
    free_revoked(occ, member, token)
    results[#results + 1] = 0
  end
end
return results
