--[[
  remove: take schedules out of the index entirely (delete, drift repair), leaving a tombstone
  (the version) in `gone` so that a write of an older or equal version (a rebuild that read
  the schedule before it was deleted) cannot bring it back. An occurrence in flight becomes
  stale; triggers still queued are dropped when claimed (their schedule is gone).

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  KEYS[5] gone   HASH  ns/id  -> "version|ms|kind" tombstone (kind d: deleted)
  ARGV[1] now_ms (ms, optional: '' reads the server clock; tests only)
  ARGV[2..] pairs: member, version ('' : whatever version is stored)

  Returns one code per pair: 1 removed, 0 not indexed, -1 stale (a newer version is stored).
]]
local due, lease, occ, sched, gone = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local results = {}
for i = 2, #ARGV, 2 do
  local member, version = ARGV[i], ARGV[i + 1]
  local current = redis.call('HGET', sched, member)
  local stored = current and tonumber(string.match(current, '^{"v":(%d+)'))
  if stored and version ~= '' and stored > tonumber(version) then
    results[#results + 1] = -1
  else
    local buried = version ~= '' and tonumber(version) or stored
    if buried then
      local previous = redis.call('HGET', gone, member)
      local previous_version = previous and tonumber(string.match(previous, '^(%d+)'))
      if not previous_version or previous_version < buried then
        redis.call('HSET', gone, member, string.format('%d', buried) .. '|' .. now .. '|d')
      end
    end
    local existed = redis.call('HDEL', sched, member)
    existed = existed + redis.call('ZREM', due, member) + redis.call('ZREM', lease, member)
    redis.call('HDEL', occ, member)
    results[#results + 1] = existed > 0 and 1 or 0
  end
end
return results
