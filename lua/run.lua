--[[
  run: a run outside the rotation (a trigger) written to the index with the position of the
  transaction that made it durable in PostgreSQL (invariant 9), both at once: the intake after
  its commit, and the sweeper's replay of a shard that lacks the position (a failover to a
  replica that lagged, an older snapshot). Whichever comes second finds the position applied
  and writes nothing: a run the first one wrote may have been claimed and completed since, and
  must not be put back.

  KEYS[1] due    ZSET   member -> fire time (ms)
  KEYS[2] lease  ZSET   member -> lease deadline (ms)
  KEYS[3] pos    STRING the shard's position (advance.lua)
  KEYS[4] ahead  ZSET   positions applied past a gap (advance.lua)
  ARGV[1] member    the run's member (`ns/id#<fire ms>`)
  ARGV[2] fire_ms   (ms) when it is due
  ARGV[3] position  of the transaction that made it durable

  Returns 1 added, 0 not: its position is applied already, or it is due or in flight.
]]
local due, lease, pos, ahead = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, fire_ms, position = ARGV[1], ARGV[2], tonumber(ARGV[3])

--!include lib/position.lua

if position_applied(pos, ahead, position) then
  return 0
end
local added = 0
if not redis.call('ZSCORE', lease, member) then
  added = redis.call('ZADD', due, 'NX', fire_ms, member)
end
position_advance(pos, ahead, 'note', position)
return added
