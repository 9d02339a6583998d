--[[
  report: the outcome of delivery attempts, for Retry-After holds and circuit breakers shared
  by every executor. A success closes its rate key's breaker; a failed attempt adds to its
  consecutive failures, and `breaker_failures` of them open it for `cooldown_ms` (a failed
  probe opens it again). A Retry-After holds the rate key until then (the latest hold wins).

  KEYS pairs, one per attempt:
    hold     STRING end of a Retry-After hold (ms), expires with it
    breaker  HASH   fails, open_until (ms), probe_until (ms); expires when idle
  ARGV[1] now_ms            (ms, optional: '' reads the server clock; tests only)
  ARGV[2] breaker_failures  (count)
  ARGV[3] cooldown_ms       (ms) how long an open breaker holds its rate key
  ARGV[4] idle_ms           (ms) a breaker key with no failure for this long is forgotten
  ARGV pairs from ARGV[5], one per attempt: ok ('1' up, '0' down, '2' nothing sent: a probe
    gives its slot back, the breaker otherwise unchanged), retry_after_ms ('' : none)

  Returns one code per attempt: 0 no change, 1 the breaker closed, 2 the breaker opened.
]]
--!include lib/clock.lua
local now = clock_ms(ARGV[1])
local threshold, cooldown, idle = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])

local results = {}
for i = 1, #KEYS / 2 do
  local hold_key, breaker_key = KEYS[2 * i - 1], KEYS[2 * i]
  local ok, retry_after = ARGV[3 + 2 * i], ARGV[4 + 2 * i]
  if retry_after ~= '' and tonumber(retry_after) > 0 then
    local wait = tonumber(retry_after)
    local current = tonumber(redis.call('GET', hold_key) or '0')
    if now + wait > current then
      redis.call('SET', hold_key, now + wait, 'PX', wait)
    end
  end
  local code = 0
  if ok == '1' then
    local fails = tonumber(redis.call('HGET', breaker_key, 'fails') or '0')
    if fails > 0 then
      redis.call('DEL', breaker_key)
      if fails >= threshold then
        code = 1
      end
    end
  elseif ok == '2' then
    if redis.call('EXISTS', breaker_key) == 1 then
      redis.call('HSET', breaker_key, 'probe_until', 0)
    end
  else
    local fails = redis.call('HINCRBY', breaker_key, 'fails', 1)
    local open_until = tonumber(redis.call('HGET', breaker_key, 'open_until') or '0')
    if fails >= threshold and open_until <= now then
      redis.call('HSET', breaker_key, 'open_until', now + cooldown, 'probe_until', 0)
      code = 2
    end
    redis.call('PEXPIRE', breaker_key, cooldown + idle)
  end
  results[#results + 1] = code
end
return results
