--[[
  unpark: release occurrences parked behind a rate key (park.lua) once its gate can let them
  through, or look at the key again later. For each rate key, as the caller decided from the
  key's gate: up to `count` of its parked occurrences (oldest deadline first) come due again,
  spread evenly over `spread_ms` from now, and the key's next look is at `next_wake_ms` (the
  key leaves the registry when nothing is left parked). A member no longer parked there (paused,
  deleted, reset, delivered or claimed since: its `due` score is not its parked deadline, or it
  holds a token) is dropped from the set and not released. Either way its parked mark in `pkm`
  goes (when it is still this set's: the member may be parked again, behind another key).

  A probe (the half-open breaker's one occurrence) goes round the schedules parked behind the
  key: it is the first parked occurrence (oldest deadline first) whose schedule has not been
  the key's probe yet, else the one whose schedule was the probe longest ago, and its
  schedule's turn in `pq` becomes the latest. So a schedule whose probe failed, parked again
  behind the key, is the probe again only once every other schedule parked there has been one
  since (its deadline, its wake plus a fixed offset by a hash of its member, may well stay the
  oldest for many cooldowns). The turns go with the key's last parked member.

  Fenced by the wake read: when the key's wake in the registry is no longer `seen_wake`
  (another executor released it meanwhile, or a new hold moved it), nothing is done for it.

  KEYS[1] due     ZSET  member -> fire time (ms)
  KEYS[2] occ     HASH  member -> "nominal|attempt|token|fires[|flags]"
  KEYS[3] parked  ZSET  rate key -> wake (ms)
  KEYS[4] rates   HASH  rate key -> "interval_ms|burst"
  KEYS[5] pkm     HASH  member -> its parked deadline in `due` (ms)
  KEYS after those, two per rate key: its parked set of the shard and its probes' turns,
          pk      ZSET  member -> parked deadline (ms)
          pq      ZSET  schedule (`ns/id`) -> its turn (1, 2, ...): when it was last released
                        as the key's probe
  ARGV[1] now_ms     (ms, optional: '' reads the server clock; tests only)
  ARGV[2] spread_ms  (ms) released occurrences come due over this long
  ARGV quintuples from ARGV[3], one per rate key: rate key, seen_wake (ms), count (most to
    release), next_wake_ms (ms, absolute), probe ('1': the one released is the probe)

  Returns one pair per rate key: released (-1: fenced off, nothing done), still parked.
]]
local due, occ, parked, rates, pkm = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
--!include lib/clock.lua
local now = clock_ms(ARGV[1])
local spread = tonumber(ARGV[2])
--[[ At most this many stale entries are dropped per key and call beyond `count`, so one call
  stays short whatever the set holds; the rest go on the next call. ]]
local MAX_STALE = 1000
--[[ A probe is looked for among at most this many parked members whose schedules have had a
  turn, so one call stays short however many failed probes sit in front. ]]
local MAX_TURNS = 1000
--[[ The turns of a key whose parked set an executor of an older version drained (it leaves
  them behind) are forgotten after this long. ]]
local ROUND_TTL_MS = 86400000

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

local function schedule_of(member)
  return string.match(member, '^[^#]*')
end

-- Up to `count` parked members, oldest deadline first, each taken out of `pk`; stale ones
-- met on the way are dropped.
local function take_oldest(pk, count)
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
  return chosen
end

-- The parked member of `pk` (oldest deadline first) whose schedule has never been the key's
-- probe (no turn in `pq`), else the one whose schedule's turn is the oldest, with its deadline;
-- nil when none is left. Stale members met before a fresh one are dropped; only the turn of
-- one passed over is read (the one chosen among them is checked by the caller).
local function next_turn(pk, pq)
  local offset, stale, passed = 0, 0, 0
  local member, deadline, turn
  while stale < MAX_STALE and passed < MAX_TURNS do
    local batch = redis.call('ZRANGE', pk, offset, offset + 99, 'WITHSCORES')
    if #batch == 0 then
      break
    end
    for j = 1, #batch, 2 do
      local had = tonumber(redis.call('ZSCORE', pq, schedule_of(batch[j])) or '0')
      if had > 0 then
        if not turn or had < turn then
          member, deadline, turn = batch[j], batch[j + 1], had
        end
        offset = offset + 1 -- stays parked in its place: the next batch starts after it
        passed = passed + 1
      elseif still_parked(batch[j], batch[j + 1]) then
        return batch[j], batch[j + 1] -- never the probe: its turn now
      else
        redis.call('ZREM', pk, batch[j])
        unmark(batch[j], batch[j + 1])
        stale = stale + 1
      end
    end
  end
  return member, deadline
end

-- The probe, taken out of `pk`, its schedule's turn now the latest. A stale member chosen
-- among those that had a turn is dropped and the next looked for (a few times at most).
local function take_probe(pk, pq)
  for _ = 1, 3 do
    local member, deadline = next_turn(pk, pq)
    if not member then
      return {}
    end
    redis.call('ZREM', pk, member)
    unmark(member, deadline)
    if still_parked(member, deadline) then
      local last = redis.call('ZRANGE', pq, -1, -1, 'WITHSCORES')
      redis.call('ZADD', pq, tonumber(last[2] or '0') + 1, schedule_of(member))
      redis.call('PEXPIRE', pq, ROUND_TTL_MS)
      return {member}
    end
  end
  return {}
end

local results = {}
local item = 0
for i = 3, #ARGV, 5 do
  item = item + 1
  local rate_key, seen, count, next_wake =
    ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local probe = ARGV[i + 4] == '1'
  local pk, pq = KEYS[4 + 2 * item], KEYS[5 + 2 * item]
  local wake = redis.call('ZSCORE', parked, rate_key)
  if not wake or tonumber(wake) ~= seen then
    results[#results + 1] = -1
    results[#results + 1] = redis.call('ZCARD', pk)
  else
    local chosen
    if probe and count > 0 then
      chosen = take_probe(pk, pq)
    else
      chosen = take_oldest(pk, count)
    end
    for j, member in ipairs(chosen) do
      redis.call('ZADD', due, now + math.floor(spread * (j - 1) / #chosen), member)
    end
    local left = redis.call('ZCARD', pk)
    if left == 0 then
      redis.call('ZREM', parked, rate_key)
      redis.call('HDEL', rates, rate_key)
      redis.call('DEL', pq)
    else
      redis.call('ZADD', parked, next_wake, rate_key)
    end
    results[#results + 1] = #chosen
    results[#results + 1] = left
  end
end
return results
