--[[
  remove: take schedules out of the index entirely (delete, drift repair), leaving a tombstone
  (the version) in `gone` so that a write of an older or equal version (a rebuild that read
  the schedule before it was deleted) cannot bring it back. An occurrence in flight becomes
  stale, and leaves a marker `ns/id!` (see upsert.lua) so that the same id created again waits
  for that delivery to end; triggers still queued are dropped when claimed (their schedule is
  gone).

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]";
                        member .. '!' -> "token|lease deadline" (kept: see above)
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  KEYS[5] gone   HASH  ns/id  -> "version|ms|kind" tombstone (kind d: deleted)
  KEYS[6] bf     HASH  ns/id  -> a running backfill (backfill.lua): dropped with its member
                              `ns/id#b` (one in flight becomes stale, its marker `ns/id#b!`
                              holding the same id created again the same way)
  KEYS[7] pkm    HASH  member -> parked deadline (park.lua): the mark goes with its member
                              (and its backfill's)
  ARGV[1] now_ms (ms, optional: '' reads the server clock; tests only)
  ARGV[2..] pairs: member, version ('' : whatever version is stored)

  Returns one code per pair: 1 removed, 0 not indexed, -1 stale (a newer version is stored).
]]
local due, lease, occ, sched, gone, bf = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local pkm = KEYS[7]
--!include lib/clock.lua
--!include lib/plan_version.lua
local now = clock_ms(ARGV[1])

-- An occurrence in flight leaves its marker (as upsert.lua's revoke does): a schedule created
-- again under the same id waits for that delivery to end (claim.lua). forget.lua drops the
-- marker with the tombstone once its deadline has passed.
--!include lib/revoked.lua

local results = {}
for i = 2, #ARGV, 2 do
  local member, version = ARGV[i], ARGV[i + 1]
  local current = redis.call('HGET', sched, member)
  local stored = plan_version(current)
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
    keep_in_flight(lease, occ, member)
    local existed = redis.call('HDEL', sched, member)
    existed = existed + redis.call('ZREM', due, member) + redis.call('ZREM', lease, member)
    redis.call('HDEL', occ, member)
    redis.call('HDEL', pkm, member)
    if redis.call('HDEL', bf, member) == 1 then
      local backfill = member .. '#b'
      keep_in_flight(lease, occ, backfill)
      redis.call('ZREM', due, backfill)
      redis.call('ZREM', lease, backfill)
      redis.call('HDEL', occ, backfill)
      redis.call('HDEL', pkm, backfill)
    end
    results[#results + 1] = existed > 0 and 1 or 0
  end
end
return results
