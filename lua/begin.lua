--[[
  begin: as an executor starts a delivery, check that each occurrence's token is still current
  and hold its lease for the delivery (at least until now + hold_ms). Called when the delivery
  really starts (a concurrency slot is free), so a lease that expired while the occurrence
  waited is never delivered on: the sweeper has handed it out again.

  KEYS[1] lease  ZSET  member -> lease deadline (ms)
  KEYS[2] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
  ARGV[1] now_ms (ms, optional: '' reads the server clock; tests only)
  ARGV[2..] triples: member, token, hold_ms (ms)

  Returns {now_ms, code per triple...}: 1 current (lease held), 0 stale (completed, retried,
  reclaimed or revoked since the message was published: do not deliver). now_ms is the Redis
  clock, which misfire decisions use (never the executor host's clock).
]]
local lease, occ = KEYS[1], KEYS[2]
--!include lib/clock.lua
local now = clock_ms(ARGV[1])

local results = {now}
for i = 2, #ARGV, 3 do
  local member, token, hold = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local current = redis.call('HGET', occ, member)
  if current and redis.call('ZSCORE', lease, member)
      and string.match(current, '^[^|]*|[^|]*|([^|]*)|') == token then
    redis.call('ZADD', lease, 'GT', now + hold, member)
    results[#results + 1] = 1
  else
    -- A stale token leaves a revoked occurrence's marker (upsert.lua) alone: this copy will
    -- not deliver, but another copy of the same message (a broker redelivery) may still be
    -- delivering it; only an attempt's end (complete, retry, defer, release) or its lease
    -- deadline frees the new rotation.
    results[#results + 1] = 0
  end
end
return results
