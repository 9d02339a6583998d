--[[
  unpark: release occurrences parked behind a rate key (park.lua) once its gate can let them
  through, or look at the key again later. For each rate key, as the caller decided from the
  key's gate: up to `count` of its parked occurrences (oldest deadline first) come due again,
  spread evenly over `spread_ms` from now, and the key's next look is at `next_wake_ms` (the
  key leaves the registry when nothing is left parked). A member no longer parked there (paused,
  deleted, reset, delivered or claimed since: its `due` score is not its parked deadline, or it
  holds a token) is dropped from the set and not released. Either way its parked mark in `pkm`
  goes (when it is still this set's: the member may be parked again, behind another key).

  Fenced by the wake read: when the key's wake in the registry is no longer `seen_wake`
  (another executor released it meanwhile, or a new hold moved it), nothing is done for it.

  KEYS[1] due     ZSET  member -> fire time (ms)
  KEYS[2] occ     HASH  member -> "nominal|attempt|token|fires[|flags]"
  KEYS[3] parked  ZSET  rate key -> wake (ms)
  KEYS[4] rates   HASH  rate key -> "interval_ms|burst"
  KEYS[5] pkm     HASH  member -> its parked deadline in `due` (ms)
  KEYS after those, one per rate key: its parked set of the shard,
          pk      ZSET  member -> parked deadline (ms)
  ARGV[1] now_ms     (ms, optional: '' reads the server clock; tests only)
  ARGV[2] spread_ms  (ms) released occurrences come due over this long
  ARGV quadruples from ARGV[3], one per rate key: rate key, seen_wake (ms), count (most to
    release), next_wake_ms (ms, absolute)

  Returns one pair per rate key: released (-1: fenced off, nothing done), still parked.
]]
local due, occ, parked, rates, pkm = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
--!include lib/clock.lua
local now = clock_ms(ARGV[1])
local spread = tonumber(ARGV[2])
--[[ At most this many stale entries are dropped per key and call beyond `count`, so one call
  stays short whatever the set holds; the rest go on the next call. ]]
local MAX_STALE = 1000

local function still_parked(member, deadline)
  local score = redis.call('ZSCORE', due, member)
  if not score or tonumber(score) ~= tonumber(deadline) then
    return false
  end
  local current = redis.call('HGET', occ, member)
  return current ~= false and string.match(current, '^[^|]*|[^|]*|([^|]*)|') == ''
end

local function unmark(member, deadline)
  local marked = redis.call('HGET', pkm, member)
  if marked and tonumber(marked) == tonumber(deadline) then
    redis.call('HDEL', pkm, member)
  end
end

local results = {}
local item = 0
for i = 3, #ARGV, 4 do
  item = item + 1
  local rate_key, seen, count, next_wake =
    ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local pk = KEYS[5 + item]
  local wake = redis.call('ZSCORE', parked, rate_key)
  if not wake or tonumber(wake) ~= seen then
    results[#results + 1] = -1
    results[#results + 1] = redis.call('ZCARD', pk)
  else
    local chosen, scanned = {}, 0
    while #chosen < count and scanned < count + MAX_STALE do
      local batch = redis.call('ZRANGE', pk, 0, math.min(count - #chosen, 500) - 1, 'WITHSCORES')
      if #batch == 0 then
        break
      end
      for j = 1, #batch, 2 do
        redis.call('ZREM', pk, batch[j])
        unmark(batch[j], batch[j + 1])
        scanned = scanned + 1
        if still_parked(batch[j], batch[j + 1]) then
          chosen[#chosen + 1] = batch[j]
        end
      end
    end
    for j, member in ipairs(chosen) do
      redis.call('ZADD', due, now + math.floor(spread * (j - 1) / #chosen), member)
    end
    local left = redis.call('ZCARD', pk)
    if left == 0 then
      redis.call('ZREM', parked, rate_key)
      redis.call('HDEL', rates, rate_key)
    else
      redis.call('ZADD', parked, next_wake, rate_key)
    end
    results[#results + 1] = #chosen
    results[#results + 1] = left
  end
end
return results
