--[[
  backfill: start a schedule's backfill, replacing the one it has (the intake), or put a
  backfill kept in PostgreSQL back into an index that lost it (the rebuild, drift repair).

  A backfill runs through one member per schedule, `ns/id#b`, one occurrence at a time: its
  occ state holds the current nominal time and the backfill's generation, and `bf` holds what
  the executors' completions need to go on (see complete.lua). claim.lua never leases `ns/id#b`
  while `ns/id` is in flight, nor the other way round.

  A replacement drops the old backfill's occurrences at once, except one in flight: that one
  may finish, and the new backfill's first occurrence (`start`) takes its place when it
  completes (complete.lua) or when it comes back to be claimed again (claim.lua), so the two
  never overlap. A write of a generation not newer than the one held changes nothing.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|generation" for ns/id#b
  KEYS[4] bf     HASH  ns/id  -> "generation|to_ms|remaining|start|paused"
  KEYS[5] pos    STRING the shard's position (advance.lua)
  KEYS[6] ahead  ZSET   positions applied past a gap (advance.lua)
  ARGV[1] member     (ns/id) the schedule
  ARGV[2] generation (count) newer for every backfill command of the schedule
  ARGV[3] to_ms      (ms) end of the backfill, exclusive
  ARGV[4] remaining  (count) occurrences left to deliver (0: none; the running one is dropped)
  ARGV[5] first_ms   (ms) nominal time of the first of them ('' when remaining is 0)
  ARGV[6] position   of the transaction that made it durable in PostgreSQL ('': none; the
                     rebuild and drift repair). Given, the write and the position are made at
                     once (invariant 9), and nothing is written when the position is applied
                     already: the intake after its commit and the sweeper's replay of a shard
                     that lacks the position each write it, whichever comes first; one written
                     then may have delivered occurrences since.

  A paused schedule's backfill waits for its resume (upsert.lua). Whether it is paused is read
  here, not from the caller: a paused schedule is out of rotation (neither due nor in flight),
  and a pause or resume committed after the caller read the schedule may reach the index first.

  Returns 1 written, 0 stale (a generation at least as new is held, or the position is
  applied already).
]]
local due, lease, occ, bf, pos, ahead = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local base, generation, to_ms = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local remaining, first_ms = tonumber(ARGV[4]), ARGV[5]
local position = tonumber(ARGV[6] or '')
local member = base .. '#b'

--!include lib/position.lua

if position then
  if position_applied(pos, ahead, position) then
    return 0
  end
  position_advance(pos, ahead, 'note', position)
end
local in_rotation = redis.call('ZSCORE', due, base) or redis.call('ZSCORE', lease, base)
local paused = in_rotation and '' or '1'

local held = redis.call('HGET', bf, base)
local held_generation = held and tonumber(string.match(held, '^(%d+)'))
if held_generation and held_generation >= generation then
  return 0
end

local in_flight = redis.call('ZSCORE', lease, member)
if not in_flight then
  redis.call('ZREM', due, member)
  redis.call('HDEL', occ, member)
end
if remaining <= 0 then
  redis.call('HDEL', bf, base)
  return 1
end
local head = string.format('%d', generation) .. '|' .. to_ms .. '|' .. string.format('%d', remaining)
if in_flight then
  -- The old backfill's occurrence in flight finishes first; this one starts after it.
  redis.call('HSET', bf, base, head .. '|' .. first_ms .. '|' .. paused)
else
  redis.call('HSET', bf, base, head .. '||' .. paused)
  redis.call('HSET', occ, member, first_ms .. '|1||' .. string.format('%d', generation))
  if paused ~= '1' then
    redis.call('ZADD', due, first_ms, member)
  end
end
return 1
