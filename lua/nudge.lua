--[[
  nudge: look at rate keys' parked occurrences (park.lua) at once, in this shard: each key's
  wake in the registry is lowered to a value no look has read before (0, then -1, -2, ...), so
  a look that read the key's gate before the nudge is fenced off (unpark.lua compares the wake
  it read) instead of moving the wake back to a hold that no longer holds. A key not parked
  here is not added.

  KEYS[1] parked  ZSET  rate key -> wake (ms)
  ARGV    the rate keys

  Returns how many keys were nudged.
]]
local parked = KEYS[1]
local nudged = 0
for _, rate_key in ipairs(ARGV) do
  local wake = redis.call('ZSCORE', parked, rate_key)
  if wake then
    redis.call('ZADD', parked, math.min(tonumber(wake), 1) - 1, rate_key)
    nudged = nudged + 1
  end
end
return nudged
