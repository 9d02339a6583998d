--[[
  complete: for each finished occurrence whose token is still current, drop its lease and put
  the schedule's next occurrence into `due` (the "ack by rescheduling"). A stale token (the
  occurrence was reclaimed, retried, revoked or already completed) changes nothing.

  A schedule that is over leaves a tombstone (its version) in `gone`, so that no later write
  of that version (a drift repair or a rebuild that read PostgreSQL before the checkpoint of
  this completion landed there) can put it back into rotation.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  KEYS[5] gone   HASH  ns/id  -> "version|ms|kind": schedules deleted (d) or finished (f)
  KEYS[6] bf     HASH  ns/id  -> "generation|to_ms|remaining|start|paused" (backfill.lua)
  ARGV[1] now_ms (ms, optional: '' reads the server clock; tests only)
  ARGV[2..] quintuples: member, token,
                   next_fire_ms ('' : no next occurrence),
                   next_occ ('' : the next occurrence has the default state),
                   finish ('1' : the schedule is over; drop its stored copy and its backfill)

  A backfill member (`ns/id#b`) passes the schedule's next nominal time after its own as
  next_fire_ms; this script decides whether the backfill goes on (before its `to`, with
  occurrences left), and only for the generation that is current: an occurrence of a replaced
  backfill hands its place to the new backfill's first occurrence instead.

  Returns one code per quintuple: 0 stale, else 1 completed; for a backfill member, 1 plus the
  occurrences its backfill has left after it (1: the backfill is over, or was replaced).
]]
local due, lease, occ, sched, gone, bf = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]

--!include lib/clock.lua
--!include lib/plan_version.lua
local now = clock_ms(ARGV[1])

--!include lib/revoked.lua

local function backfill_head(generation, to_ms, remaining)
  return generation .. '|' .. to_ms .. '|' .. string.format('%d', remaining)
end

--[[ A backfill's occurrences are due at once (their times are past), and would always sort
  before a regular occurrence: one waiting for this one's lease (or coming due within the wait
  claim.lua puts it back by) goes first, and the backfill's next occurrence right after it. ]]
local TAKE_TURNS_MS = 250

local function place_backfill(member, base, nominal, generation, paused)
  redis.call('HSET', occ, member, nominal .. '|1||' .. generation)
  if paused ~= '1' then
    local at = tonumber(nominal)
    local regular = tonumber(redis.call('ZSCORE', due, base))
    if regular and regular <= now + TAKE_TURNS_MS and regular >= at then
      at = regular + 1
    end
    redis.call('ZADD', due, at, member)
  end
end

local function complete_backfill(member, base, current, next_nominal)
  redis.call('ZREM', lease, member)
  redis.call('HDEL', occ, member)
  local held = redis.call('HGET', bf, base)
  if not held then
    return 1
  end
  local generation, to_ms, remaining, start, paused =
    string.match(held, '^(%d+)|(%d+)|(%d+)|(%d*)|(%d*)$')
  if not generation then
    return 1
  end
  if string.match(current, '^[^|]*|[^|]*|[^|]*|(%d+)') ~= generation then
    if start ~= '' then
      redis.call('HSET', bf, base, backfill_head(generation, to_ms, remaining) .. '||' .. paused)
      place_backfill(member, base, start, generation, paused)
    end
    return 1
  end
  local left = tonumber(remaining) - 1
  if left > 0 and next_nominal ~= '' and tonumber(next_nominal) < tonumber(to_ms) then
    redis.call('HSET', bf, base, backfill_head(generation, to_ms, left) .. '||' .. paused)
    place_backfill(member, base, next_nominal, generation, paused)
    return 1 + left
  end
  redis.call('HDEL', bf, base)
  return 1
end

--[[ The other way round: a backfill occurrence that waited for this regular one (put back
  by claim.lua, due within the wait) goes before the rotation's next. A rotation that is
  always behind (a target slower than its period) has its next time in the past, which would
  sort before the waiting backfill occurrence every time and starve it. ]]
local function backfill_turn(base, next_fire)
  local member = base .. '#b'
  local waiting = tonumber(redis.call('ZSCORE', due, member))
  if waiting and waiting <= now + TAKE_TURNS_MS and waiting >= tonumber(next_fire) then
    redis.call('ZADD', due, tonumber(next_fire) - 1, member)
  end
end

-- A schedule that is over takes its backfill with it (one in flight may finish).
local function drop_backfill(base)
  if redis.call('HDEL', bf, base) == 1 then
    local member = base .. '#b'
    if not redis.call('ZSCORE', lease, member) then
      redis.call('ZREM', due, member)
      redis.call('HDEL', occ, member)
    end
  end
end
local results = {}
for i = 2, #ARGV, 5 do
  local member, token, next_fire, next_occ, finish =
    ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local current = redis.call('HGET', occ, member)
  if current and string.match(current, '^[^|]*|[^|]*|([^|]*)|') == token
      and string.sub(member, -2) == '#b' then
    results[#results + 1] = complete_backfill(member, string.match(member, '^[^#]*'), current,
      next_fire)
  elseif current and string.match(current, '^[^|]*|[^|]*|([^|]*)|') == token then
    local base = string.match(member, '^[^#]*')
    redis.call('ZREM', lease, member)
    redis.call('HDEL', occ, member)
    if next_fire ~= '' then
      redis.call('ZADD', due, next_fire, base)
      if next_occ ~= '' then
        redis.call('HSET', occ, base, next_occ)
      end
      if member == base and redis.call('HEXISTS', bf, base) == 1 then
        backfill_turn(base, next_fire)
      end
    end
    if finish == '1' then
      local plan = redis.call('HGET', sched, base)
      local version = plan_version(plan)
      if version then
        redis.call('HSET', gone, base, string.format('%d', version) .. '|' .. now .. '|f')
      end
      redis.call('HDEL', sched, base)
      drop_backfill(base)
    end
    results[#results + 1] = 1
  else
    free_revoked(occ, member, token)
    results[#results + 1] = 0
  end
end
return results
