--[[
  release: a dispatcher hands back occurrences it claimed but could not publish. Each goes back
  into `due` (due now) with its token cleared and its attempt unchanged, as if reclaimed.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
  ARGV[1] now_ms (ms, optional: '' reads the server clock; tests only)
  ARGV[2..] pairs: member, token

  Returns one code per pair: 1 released, 0 stale (token no longer current).
]]
local due, lease, occ = KEYS[1], KEYS[2], KEYS[3]
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local results = {}
for i = 2, #ARGV, 2 do
  local member, token = ARGV[i], ARGV[i + 1]
  local current = redis.call('HGET', occ, member)
  local nominal, attempt, current_token, fires
  if current then
    nominal, attempt, current_token, fires =
      string.match(current, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  end
  if current_token == token then
    redis.call('ZREM', lease, member)
    redis.call('HSET', occ, member, nominal .. '|' .. attempt .. '||' .. fires)
    redis.call('ZADD', due, now, member)
    results[#results + 1] = 1
  else
    results[#results + 1] = 0
  end
end
return results
