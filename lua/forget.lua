--[[
  forget: drop tombstones the sweeper found settled in PostgreSQL, each only if it still holds
  the value the sweeper read (a newer delete or finish since then keeps its tombstone).

  KEYS[1] gone  HASH ns/id -> "version|ms|kind" tombstone
  ARGV pairs: member, value read

  Returns the number of tombstones dropped.
]]
local gone = KEYS[1]
local dropped = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', gone, ARGV[i]) == ARGV[i + 1] then
    dropped = dropped + redis.call('HDEL', gone, ARGV[i])
  end
end
return dropped
