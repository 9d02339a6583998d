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
--!include lib/clock.lua
local now = clock_ms(ARGV[1])

--!include lib/revoked.lua
--!include lib/requeue.lua

local results = {}
for i = 2, #ARGV, 2 do
  local member, token = ARGV[i], ARGV[i + 1]
  local nominal, attempt, current_token, tail = occ_fields(redis.call('HGET', occ, member))
  if current_token == token then
    requeue(due, lease, occ, member, nominal, attempt, tail, now, false)
    results[#results + 1] = 1
  else
    free_revoked(occ, member, token)
    results[#results + 1] = 0
  end
end
return results
