--[[
  gate: admit a batch of deliveries to their rate keys, shared by every executor. For each
  delivery, in order: a Retry-After hold or an open circuit breaker holds it until its end; a
  half-open breaker lets one probe through and holds the others; a rate limit (GCRA) admits it
  now, or reserves a slot for it at most `max_reserve_ms` ahead, or holds it until a slot that
  close would be free. Reservations are made here, so two executors never take the same slot.

  KEYS triples, one per delivery:
    tat      STRING theoretical arrival time of the rate key's next slot (ms), expires idle
    hold     STRING end of a Retry-After hold (ms), expires with it
    breaker  HASH   fails (consecutive failed attempts), open_until (ms), probe_until (ms),
                    probes (count: probes let through since it opened; the executors release
                    the next probe from the shard this turns to: shared.policy.holds.shares)
  ARGV[1] now_ms            (ms, optional: '' reads the server clock; tests only)
  ARGV[2] breaker_failures  (count) failures that open a breaker
  ARGV[3] max_reserve_ms    (ms) longest wait a reservation may have
  ARGV triples from ARGV[4], one per delivery:
    interval_ms (ms per delivery; 0: no rate limit), burst (count),
    probe_ms (ms a probe may take before another is let through)

  Returns one triple per delivery: code, ms, flags
    code 0: go now; 1: go after waiting ms (slot reserved); 2: held until ms (absolute)
    flags bit 1: this delivery is the breaker's probe; bit 2: the breaker counts failures
    (only then does a success need reporting)
]]
--!include lib/clock.lua
local now = clock_ms(ARGV[1])
local threshold = tonumber(ARGV[2])
local max_reserve = tonumber(ARGV[3])

local results = {}
local fails = 0
local function answer(code, ms, probe)
  results[#results + 1] = code
  results[#results + 1] = math.floor(ms)
  results[#results + 1] = probe + (fails > 0 and 2 or 0)
end

for i = 1, #KEYS / 3 do
  local tat_key, hold_key, breaker_key = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local a = 4 + (i - 1) * 3
  local interval, burst, probe_ms = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local hold = tonumber(redis.call('GET', hold_key) or '0')
  local b = redis.call('HMGET', breaker_key, 'fails', 'open_until', 'probe_until')
  fails = tonumber(b[1] or '0')
  local open_until = tonumber(b[2] or '0')
  local probe_until = tonumber(b[3] or '0')
  local probe = 0
  if hold > now then
    answer(2, hold, 0)
  elseif open_until > now then
    answer(2, open_until, 0)
  elseif fails >= threshold and probe_until > now then
    answer(2, probe_until, 0)
  else
    if fails >= threshold then
      redis.call('HSET', breaker_key, 'probe_until', now + probe_ms)
      redis.call('HINCRBY', breaker_key, 'probes', 1)
      probe = 1
    end
    if interval <= 0 then
      answer(0, 0, probe)
    else
      local tat = math.max(tonumber(redis.call('GET', tat_key) or '0'), now)
      local allowed_at = tat - interval * (burst - 1)
      local wait = allowed_at - now
      if wait > max_reserve then
        if probe == 1 then
          redis.call('HSET', breaker_key, 'probe_until', 0)
        end
        answer(2, allowed_at - max_reserve / 2, 0)
      else
        local next_tat = tat + interval
        redis.call('SET', tat_key, string.format('%.3f', next_tat),
          'PX', math.ceil(next_tat - now) + 1000)
        if wait > 0 then
          answer(1, wait, probe)
        else
          answer(0, 0, probe)
        end
      end
    end
  end
end
return results
