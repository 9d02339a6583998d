--[[
  begin: as an executor starts a delivery, check that each occurrence's token is still current
  and hold its lease for the delivery (at least until now + hold_ms). Called when the delivery
  really starts (a concurrency slot is free), so a lease that expired while the occurrence
  waited is never delivered on: the sweeper has handed it out again. Also called, with
  `delivering` off, to hold the leases of occurrences still waiting for a slot.

  A delivery that starts flags its occurrence catch-up ('c'): from here on it may have gone
  out, so should this executor die before the completion, the copy that takes it over (the
  message redelivered, or the lease reclaimed) delivers it again (same key) rather than judging
  it missed and moving on without counting it (one fire more than max_fires otherwise). An
  occurrence already missed (now past its `cutoff`, its due time plus the misfire grace) is not
  flagged: the executor judges it, and flags it with a second call (no cutoff) only if its
  policy still delivers it, so one it skips is judged again by whoever takes it over.

  KEYS[1] lease  ZSET  member -> lease deadline (ms)
  KEYS[2] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
  ARGV[1] now_ms (ms, optional: '' reads the server clock; tests only)
  ARGV[2] delivering ('1': the deliveries start now; '0' or '': the leases are only held)
  ARGV[3..] quadruples: member, token, hold_ms (ms), cutoff (ms; '': never missed, e.g. a
            trigger, a retry or a catch-up)

  Returns {now_ms, code per quadruple...}: 1 current (lease held; flagged when delivering),
  2 current and flagged before (an earlier copy began its delivery, or the misfire policy let
  it through already: deliver it, do not judge it again), 3 current but missed and not flagged
  (judge it), 0 stale (completed, retried, reclaimed or revoked since the message was
  published: do not deliver). now_ms is the Redis clock, which misfire decisions use (never
  the executor host's clock).
]]
local lease, occ = KEYS[1], KEYS[2]
--!include lib/clock.lua
local now = clock_ms(ARGV[1])
local delivering = ARGV[2] == '1'

local results = {now}
for i = 3, #ARGV, 4 do
  local member, token, hold, cutoff = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  local current = redis.call('HGET', occ, member)
  if current and redis.call('ZSCORE', lease, member)
      and string.match(current, '^[^|]*|[^|]*|([^|]*)|') == token then
    redis.call('ZADD', lease, 'GT', now + hold, member)
    local flags = string.match(current, '^[^|]*|[^|]*|[^|]*|[^|]*|?(.*)$')
    if string.find(flags, 'c', 1, true) then
      results[#results + 1] = 2
    elseif not delivering then
      results[#results + 1] = 1
    elseif cutoff ~= '' and now > tonumber(cutoff) then
      results[#results + 1] = 3
    else
      redis.call('HSET', occ, member, current .. (flags == '' and '|c' or 'c'))
      results[#results + 1] = 1
    end
  else
    -- A stale token leaves a revoked occurrence's marker (upsert.lua) alone: this copy will
    -- not deliver, but another copy of the same message (a broker redelivery) may still be
    -- delivering it; only an attempt's end (complete, retry, defer, release) or its lease
    -- deadline frees the new rotation.
    results[#results + 1] = 0
  end
end
return results
