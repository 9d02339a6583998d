--[[
  wakes: the rate keys of a shard whose parked occurrences (park.lua) are due to be looked at:
  their wake time has come. Read-only; unpark.lua acts on what the caller decides.

  KEYS[1] parked  ZSET  rate key -> wake (ms)
  KEYS[2] rates   HASH  rate key -> "interval_ms|burst" of its limit
  ARGV[1] limit   (count) most rate keys to return
  ARGV[2] now_ms  (ms, optional: '' reads the server clock; tests only)

  Returns {now_ms, then triples: rate key, wake (ms), limit ("interval_ms|burst", '' unknown)}.
]]
local parked, rates = KEYS[1], KEYS[2]
local limit = tonumber(ARGV[1])
--!include lib/clock.lua
local now = clock_ms(ARGV[2])

local out = {now}
local found = redis.call('ZRANGEBYSCORE', parked, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
for i = 1, #found, 2 do
  out[#out + 1] = found[i]
  out[#out + 1] = found[i + 1]
  out[#out + 1] = redis.call('HGET', rates, found[i]) or ''
end
return out
