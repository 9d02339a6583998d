--[[
  remove: take schedules out of the index entirely (delete, drift repair). An occurrence in
  flight becomes stale; triggers still queued are dropped when claimed (their schedule is gone).

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires"
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  ARGV pairs: member, version ('' : whatever version is stored)

  Returns one code per pair: 1 removed, 0 not indexed, -1 stale (a newer version is stored).
]]
local due, lease, occ, sched = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local results = {}
for i = 1, #ARGV, 2 do
  local member, version = ARGV[i], ARGV[i + 1]
  local current = redis.call('HGET', sched, member)
  local stored = current and tonumber(string.match(current, '^{"v":(%d+)'))
  if stored and version ~= '' and stored > tonumber(version) then
    results[#results + 1] = -1
  else
    local existed = redis.call('HDEL', sched, member)
    existed = existed + redis.call('ZREM', due, member) + redis.call('ZREM', lease, member)
    redis.call('HDEL', occ, member)
    results[#results + 1] = existed > 0 and 1 or 0
  end
end
return results
