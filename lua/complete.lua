--[[
  complete: for each finished occurrence whose token is still current, drop its lease and put
  the schedule's next occurrence into `due` (the "ack by rescheduling"). A stale token (the
  occurrence was reclaimed, retried, revoked or already completed) changes nothing.

  A schedule that is over leaves a tombstone (its version) in `gone`, so that no later write
  of that version (a drift repair or a rebuild that read PostgreSQL before the checkpoint of
  this completion landed there) can put it back into rotation.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  KEYS[5] gone   HASH  ns/id  -> "version|ms|kind": schedules deleted (d) or finished (f)
  ARGV[1] now_ms (ms, optional: '' reads the server clock; tests only)
  ARGV[2..] quintuples: member, token,
                   next_fire_ms ('' : no next occurrence),
                   next_occ ('' : the next occurrence has the default state),
                   finish ('1' : the schedule is over; drop its stored copy)

  Returns one code per quintuple: 1 completed, 0 stale.
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
for i = 2, #ARGV, 5 do
  local member, token, next_fire, next_occ, finish =
    ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local current = redis.call('HGET', occ, member)
  if current and string.match(current, '^[^|]*|[^|]*|([^|]*)|') == token then
    local base = string.match(member, '^[^#]*')
    redis.call('ZREM', lease, member)
    redis.call('HDEL', occ, member)
    if next_fire ~= '' then
      redis.call('ZADD', due, next_fire, base)
      if next_occ ~= '' then
        redis.call('HSET', occ, base, next_occ)
      end
    end
    if finish == '1' then
      local plan = redis.call('HGET', sched, base)
      local version = plan and string.match(plan, '^{"v":(%d+)')
      if version then
        redis.call('HSET', gone, base, version .. '|' .. now .. '|f')
      end
      redis.call('HDEL', sched, base)
    end
    results[#results + 1] = 1
  else
    results[#results + 1] = 0
  end
end
return results
