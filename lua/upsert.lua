--[[
  upsert: the intake's (and the rebuild's, and drift repair's) write of schedules into the
  index. Writes arrive in version order: one not newer than the stored version changes nothing
  (a second write of the same version, say drift repair's and then the intake's own, is
  already applied), and neither does one not newer than a tombstone in `gone` (the schedule
  was deleted, or finished, at that version): deletes win over a rebuild that read the
  schedule before it was deleted, and a finished occurrence is never put back by a repair.
  A finish tombstone also outlives newer versions that continue the rotation ('keep',
  'resume', 'park'): a schedule that finished stays finished until a new rotation ('reset').
  Parking a finished schedule at its own version stores it out of rotation (so a trigger of
  it can still be claimed).

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
                        member .. '!' -> "token|lease deadline" of an occurrence revoked while
                        in flight: its delivery may still be under way, so the new rotation's
                        first occurrence waits for it (claim.lua), never overlapping it
  KEYS[4] sched  HASH  ns/id  -> compact schedule (starts with its version:
                        lib/plan_version.lua)
  KEYS[5] gone   HASH  ns/id  -> "version|ms|kind" tombstone (kind f: finished, d: deleted)
  KEYS[6] bf     HASH  ns/id  -> "generation|to_ms|remaining|start|paused" (backfill.lua)
  KEYS[7] pkm    HASH  member -> parked deadline (ms) of an occurrence parked behind a rate key
                        (park.lua)
  ARGV sextuples: member, version, schedule, mode,
                  next_fire_ms ('' : none), next_occ ('' : default state)
    mode 'keep'   : store the schedule; keep its rotation if it has one (due or in flight),
                    else start it at next_fire_ms (a rebuild, or a change that keeps the times)
    mode 'reset'  : a new rotation: store the schedule; revoke any occurrence in flight;
                    start at next_fire_ms
    mode 'resume' : the rotation goes on after a pause: as 'reset', unless it finished
    mode 'park'   : store the schedule; revoke and take it out of rotation (paused)

  An occurrence parked behind a rate key (park.lua) is released by any write that keeps its
  rotation ('keep'): it comes due now, not at its safety deadline, and is held again only if
  its target (perhaps a new one, under another rate key) is still closed. Any other write takes
  it out of `due` (its entry in the key's parked set is dropped as stale by unpark.lua). Its
  backfill's parked occurrence is released by any write but a pause, which takes it out of
  `due`. A parked trigger is not: it waits for its key's release or its safety deadline.

  A schedule's backfill (member `ns/id#b`) follows its pause: 'park' takes it out of `due`
  (one in flight may finish; its next occurrence then waits), any other write resumes it where
  it stands. Otherwise a write leaves it alone, 'reset' too: its next occurrences follow the
  schedule as it is then.

  Returns one code per sextuple: 1 written, 0 already applied (the same version is stored;
  stored in the other form, JSON or binary, it takes the form given),
  2 stored but not started (the rotation had finished), -1 stale (a newer version is stored,
  or a tombstone at least as new).
]]
local due, lease, occ, sched, gone, bf = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local pkm = KEYS[7]
--!include lib/clock.lua
--!include lib/plan_version.lua

-- A parked occurrence (still at its parked deadline) comes due now: its schedule changed, and
-- may no longer wait on the key it was parked behind.
local function unpark(member)
  local deadline = redis.call('HGET', pkm, member)
  if not deadline then
    return
  end
  redis.call('HDEL', pkm, member)
  local score = redis.call('ZSCORE', due, member)
  if score and tonumber(score) == tonumber(deadline) then
    redis.call('ZADD', due, clock_ms(nil), member)
  end
end

-- The backfill follows the schedule's pause; any other write lets it go on where it stands,
-- and releases it if parked (as the regular occurrence: its target may have changed).
local function follow_pause(member, mode)
  local held = redis.call('HGET', bf, member)
  if not held then
    return
  end
  local head, start, paused = string.match(held, '^(%d+|%d+|%d+)|(%d*)|(%d*)$')
  if not head then
    return
  end
  local backfill = member .. '#b'
  if mode == 'park' then
    redis.call('HSET', bf, member, head .. '|' .. start .. '|1')
    redis.call('ZREM', due, backfill)
    redis.call('HDEL', pkm, backfill)
  elseif paused == '1' then
    redis.call('HSET', bf, member, head .. '|' .. start .. '|')
    if not redis.call('ZSCORE', lease, backfill) then
      local current = redis.call('HGET', occ, backfill)
      local at = start ~= '' and start or (current and string.match(current, '^(%d+)'))
      if at then
        redis.call('ZADD', due, at, backfill)
      end
    end
  else
    unpark(backfill)
  end
end

--!include lib/revoked.lua

local function revoke(member)
  keep_in_flight(lease, occ, member)
  redis.call('HDEL', pkm, member)
  redis.call('ZREM', due, member)
  redis.call('ZREM', lease, member)
  redis.call('HDEL', occ, member)
end

local function start(member, next_fire, next_occ)
  if next_fire ~= '' then
    redis.call('ZADD', due, next_fire, member)
    if next_occ ~= '' then
      redis.call('HSET', occ, member, next_occ)
    end
  end
end

local function in_rotation(member)
  return redis.call('ZSCORE', due, member) or redis.call('ZSCORE', lease, member)
end

local results = {}
for i = 1, #ARGV, 6 do
  local member, version, plan, mode, next_fire, next_occ =
    ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  local stored_plan = redis.call('HGET', sched, member)
  local stored = plan_version(stored_plan)
  local tombstone = redis.call('HGET', gone, member)
  local buried = tombstone and tonumber(string.match(tombstone, '^(%d+)'))
  local finished = tombstone and string.match(tombstone, '|f$') ~= nil
  -- Parking a finished schedule at its own version stores it (a trigger can still run).
  local parks_finished = finished and mode == 'park' and buried == version
  if (stored and stored > version) or (buried and buried >= version and not parks_finished) then
    results[#results + 1] = -1
  elseif stored and stored == version then
    -- The same schedule, perhaps in the other form (JSON or binary): it takes the form
    -- written now, and nothing else moves. A rebuild converts the index this way.
    if plan_is_json(stored_plan) ~= plan_is_json(plan) then
      redis.call('HSET', sched, member, plan)
    end
    results[#results + 1] = 0
  else
    local stays_finished = finished and mode ~= 'reset'
    if tombstone and not stays_finished then
      redis.call('HDEL', gone, member)
    end
    redis.call('HSET', sched, member, plan)
    if mode == 'park' then
      revoke(member)
    elseif stays_finished then
      revoke(member)
    elseif mode == 'reset' or mode == 'resume' then
      revoke(member)
      start(member, next_fire, next_occ)
    elseif not in_rotation(member) then
      start(member, next_fire, next_occ)
    else
      unpark(member)
    end
    follow_pause(member, mode)
    results[#results + 1] = (stays_finished and mode ~= 'park') and 2 or 1
  end
end
return results
