--[[
  forget: drop tombstones the sweeper found settled in PostgreSQL, each only if it still holds
  the value the sweeper read (a newer delete or finish since then keeps its tombstone), together
  with the marker `ns/id!` of a delivery revoked or deleted in flight (upsert.lua, remove.lua).
  While that marker's deadline is ahead the tombstone is kept too (the next look drops both):
  the delivery may still be running, and a schedule created again under the id must wait.

  KEYS[1] gone  HASH ns/id -> "version|ms|kind" tombstone
  KEYS[2] occ   HASH ns/id! (and ns/id#b!, a backfill's) -> "token|lease deadline"
  ARGV pairs: member, value read

  Returns the number of tombstones dropped.
]]
local gone, occ = KEYS[1], KEYS[2]
--!include lib/clock.lua
local now = clock_ms()

local function marker_live(field)
  local marker = redis.call('HGET', occ, field)
  if not marker then
    return false
  end
  local deadline = tonumber(string.match(marker, '|(%d+)$'))
  return deadline ~= nil and deadline > now
end

local function still_in_flight(member)
  return marker_live(member .. '!') or marker_live(member .. '#b!')
end

local dropped = 0
for i = 1, #ARGV, 2 do
  local member = ARGV[i]
  if redis.call('HGET', gone, member) == ARGV[i + 1] and not still_in_flight(member) then
    dropped = dropped + redis.call('HDEL', gone, member)
    redis.call('HDEL', occ, member .. '!', member .. '#b!')
  end
end
return dropped
