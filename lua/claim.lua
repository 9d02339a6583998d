--[[
  claim: take up to `limit` occurrences that are due by now out of `due`, lease them with a
  deadline and a fresh fencing token, and return them with their schedules.

  Every value read is checked before anything is written: an entry whose stored occurrence
  state does not parse is left in `due` (pushed a minute back, so it does not block the head
  of the shard) and counted as corrupt, never lost.

  Fencing tokens never repeat, even after Redis lost its data or was restored from an older
  snapshot: each is at least the server time in microseconds, and the counter only grows.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires[|flags]"
                        (absent: nominal = fire, 1, -, 0)
                        member .. '!' -> "token|deadline": an occurrence of an earlier rotation
                        revoked while in flight (upsert.lua). Until it ends (or its lease
                        deadline passes) the member waits, pushed back PUSH_BACK_MS at a time and
                        flagged a catch-up (the wait is not lateness): one schedule never has
                        two occurrences in flight, not even across a reset
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  KEYS[5] seq    STRING fencing token counter
  KEYS[6] bf     HASH  ns/id  -> "generation|to_ms|remaining|start|paused" (backfill.lua)
  KEYS[7] pos    STRING the shard's position: the last change of PostgreSQL it holds (advance.lua)
  ARGV[1] limit     (count) most occurrences to claim
  ARGV[2] lease_ms  (ms) how long the claim holds before the sweeper may reclaim it
  ARGV[3] now_ms    (ms, optional) overrides the server clock; tests only
  ARGV[4] answered  (position, optional) the highest position a reply said ok for. An index
                    whose position is below it lacks a command already answered (a failover
                    to a lagging replica, an older snapshot): nothing is claimed from it until
                    the sweeper has replayed what it lacks (invariant 9)

  Returns {now_ms, next_due_ms (-1: none left), orphans, corrupt, waiting, fenced, claimed...}
  where fenced is 1 when the shard's position is behind `answered` (nothing else then), and
  claimed is 7 values per occurrence: member, fire_ms, nominal_ms, attempt, token, tail,
  schedule (tail: "fires" or "fires|flags"; for a backfill member `ns/id#b` the "fires" part is
  the backfill's generation). An orphan is a due member whose schedule is gone (deleted
  meanwhile), or a backfill member whose backfill is gone (replaced, deleted, done): it is
  dropped.

  One occurrence of a schedule in flight at a time, backfill included: `ns/id` is not leased
  while `ns/id#b` is (in `lease`, or claimed earlier in this call), nor the other way round.
  Such a member is put back PUSH_BACK_MS later, keeping its nominal time (a regular one
  flagged catch-up: the wait does not make it missed), and counted in `waiting`. Schedules without a backfill cost one EXISTS per call (no backfill in the shard)
  or one HEXISTS per claimed member.
]]
local due, lease, occ, sched, seq, bf = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local PUSH_BACK_MS = 250
local limit = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])

--!include lib/clock.lua
local now = clock_ms(ARGV[3])

local answered = tonumber(ARGV[4] or '')
if answered and KEYS[7] and tonumber(redis.call('GET', KEYS[7]) or '0') < answered then
  return {now, -1, 0, 0, 0, 1}
end

--[[ Fair share between namespaces. When more is due than one claim takes, the due entries
  are scanned for runs of one namespace at one fire time (a herd is one run: entries at the same
  score sort by member, so a namespace's are contiguous), up to MAX_RUNS runs, and the claim is
  shared equally between the namespaces found, so one namespace's herd cannot delay another's
  fires until it drains. One namespace alone (or no contention) claims in due order as before.
  Cost: a ZCOUNT, plus a galloping search per run, only while the backlog exceeds `limit`. ]]
local MAX_RUNS = 64

local function entry_at(rank)
  local found = redis.call('ZRANGE', due, rank, rank, 'WITHSCORES')
  return found[1], found[2]
end

local function namespace_of(member)
  return string.match(member, '^[^/]*')
end

-- The last rank of the run starting at `first` (same score, same namespace), below `limit_rank`.
local function run_end(first, limit_rank, score, namespace)
  local function same(rank)
    local member, at = entry_at(rank)
    return at == score and namespace_of(member) == namespace
  end
  local good, step = first, 1
  while good + step <= limit_rank and same(good + step) do
    good = good + step
    step = step * 2
  end
  local bad = math.min(good + step, limit_rank + 1)
  while bad - good > 1 do
    local mid = math.floor((good + bad) / 2)
    if same(mid) then good = mid else bad = mid end
  end
  return good
end

local function due_items()
  local backlog = redis.call('ZCOUNT', due, '-inf', now)
  if backlog <= limit then
    return redis.call('ZRANGEBYSCORE', due, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
  end
  local order, runs, room = {}, {}, {}
  local rank, seen = 0, 0
  while rank < backlog and seen < MAX_RUNS do
    local member, score = entry_at(rank)
    local namespace = namespace_of(member)
    local last = run_end(rank, backlog - 1, score, namespace)
    if not runs[namespace] then
      runs[namespace] = {}
      room[namespace] = 0
      order[#order + 1] = namespace
    end
    table.insert(runs[namespace], {rank, last})
    room[namespace] = room[namespace] + last - rank + 1
    seen = seen + 1
    rank = last + 1
  end
  if #order == 1 then
    return redis.call('ZRANGEBYSCORE', due, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
  end
  local share, left = {}, limit
  for _, namespace in ipairs(order) do
    share[namespace] = 0
  end
  while left > 0 do
    local open = 0
    for _, namespace in ipairs(order) do
      if room[namespace] > share[namespace] then
        open = open + 1
      end
    end
    if open == 0 then
      break
    end
    local each = math.max(1, math.floor(left / open))
    for _, namespace in ipairs(order) do
      local take = math.min(each, room[namespace] - share[namespace], left)
      share[namespace] = share[namespace] + take
      left = left - take
    end
  end
  -- Interleave the namespaces (a, b, a, b, ...) so that each one's first occurrences lead
  -- the delivery messages, rather than queue behind another namespace's whole share.
  local lists = {}
  for index, namespace in ipairs(order) do
    local list, want = {}, share[namespace]
    for _, run in ipairs(runs[namespace]) do
      if want <= 0 then
        break
      end
      local count = math.min(want, run[2] - run[1] + 1)
      local got = redis.call('ZRANGE', due, run[1], run[1] + count - 1, 'WITHSCORES')
      for _, value in ipairs(got) do
        list[#list + 1] = value
      end
      want = want - count
    end
    lists[index] = list
  end
  local items, position, added = {}, 1, true
  while added do
    added = false
    for index = 1, #order do
      local list = lists[index]
      if list[position] then
        items[#items + 1] = list[position]
        items[#items + 1] = list[position + 1]
        added = true
      end
    end
    position = position + 2
  end
  return items
end

local items = due_items()

-- The deadline of a revoked occurrence still in flight that `member` must wait for, if any;
-- a marker whose deadline has passed is dropped (its lease would have been reclaimed).
local function revoked_until(member, expired)
  local marker = redis.call('HGET', occ, member .. '!')
  if not marker then
    return nil
  end
  local deadline = tonumber(string.match(marker, '|(%d+)$'))
  if deadline and deadline > now then
    return deadline
  end
  expired[#expired + 1] = member .. '!'
  return nil
end

local backfills = redis.call('EXISTS', bf) == 1

local function parse_backfill(held)
  return string.match(held, '^(%d+)|(%d+)|(%d+)|(%d*)|(%d*)$')
end

--[[ A backfill member: nil when its backfill is gone (an orphan), 'parked' while the schedule
  is paused, else the state to claim it with. A member still holding an older generation (its
  backfill was replaced while it was in flight, and it came back: retried, reclaimed) gives its
  place to the new backfill's first occurrence. ]]
local function backfill_state(base, nominal, attempt, tail, swaps)
  local held = backfills and redis.call('HGET', bf, base)
  if not held then
    return nil
  end
  local generation, to_ms, remaining, start, paused = parse_backfill(held)
  if not generation then
    return nil
  end
  if paused == '1' then
    return 'parked'
  end
  if string.match(tail, '^(%d+)') ~= generation then
    if start == '' then
      return nil
    end
    swaps[base] = generation .. '|' .. to_ms .. '|' .. remaining .. '||' .. paused
    return {start, '1', generation}
  end
  return {nominal, attempt, tail}
end

-- The member whose lease keeps this one waiting (nil: none can).
local function sibling_of(member, base, is_backfill)
  if not backfills then
    return nil
  end
  if is_backfill then
    return base
  end
  if member == base and redis.call('HEXISTS', bf, base) == 1 then
    return base .. '#b'
  end
  return nil
end

-- Read and check everything first.
local valid, orphans, corrupt, parked, waiting, swaps, taken, expired =
  {}, {}, {}, {}, {}, {}, {}, {}
for i = 1, #items, 2 do
  local member, fire = items[i], items[i + 1]
  local base = string.match(member, '^[^#]*')
  local plan = redis.call('HGET', sched, base)
  if not plan then
    orphans[#orphans + 1] = member
  else
    local nominal, attempt, tail = fire, '1', '0'
    local current = redis.call('HGET', occ, member)
    local ok = true
    if current then
      nominal, attempt, tail = string.match(current, '^(%d+)|(%d+)|%d*|(%d+[|%a]*)$')
      ok = nominal ~= nil
    end
    local is_backfill = string.sub(member, -2) == '#b'
    if ok and is_backfill then
      local state = backfill_state(base, nominal, attempt, tail, swaps)
      if state == nil then
        orphans[#orphans + 1] = member
        ok = false
      elseif state == 'parked' then
        parked[#parked + 1] = member
        ok = false
      else
        nominal, attempt, tail = state[1], state[2], state[3]
      end
    elseif not ok then
      corrupt[#corrupt + 1] = member
    end
    if ok then
      local sibling = backfills and sibling_of(member, base, is_backfill)
      -- A backfill occurrence deleted in flight (remove.lua) holds the schedule the same way.
      local revoked = (member == base or is_backfill)
        and (revoked_until(base, expired) or revoked_until(base .. '#b', expired))
      if revoked or (sibling and (taken[sibling] or redis.call('ZSCORE', lease, sibling))) then
        waiting[#waiting + 1] = {member, nominal, attempt, tail}
      else
        if backfills then
          taken[member] = true
        end
        valid[#valid + 1] = {member, fire, nominal, attempt, tail, plan}
      end
    end
  end
end

-- Then write.
for _, member in ipairs(orphans) do
  redis.call('ZREM', due, member)
  redis.call('HDEL', occ, member)
end
for _, member in ipairs(corrupt) do
  redis.call('ZADD', due, now + 60000, member)
end
for _, field in ipairs(expired) do
  redis.call('HDEL', occ, field)
end
for _, member in ipairs(parked) do
  -- Out of due, its state kept: the resume puts it back (upsert.lua).
  redis.call('ZREM', due, member)
end
for base, value in pairs(swaps) do
  redis.call('HSET', bf, base, value)
end
for _, item in ipairs(waiting) do
  -- The state is written out: without one the nominal time would be the (moved) due score,
  -- and a backfill member may just have taken its new generation's first occurrence. A
  -- regular occurrence that waits is flagged catch-up ('c'): it goes when its turn comes,
  -- not judged late (and perhaps skipped) for the wait.
  local member, nominal, attempt, tail = item[1], item[2], item[3], item[4]
  if string.sub(member, -2) ~= '#b' and not string.find(tail, 'c', 1, true) then
    tail = string.find(tail, '|', 1, true) and (tail .. 'c') or (tail .. '|c')
  end
  redis.call('HSET', occ, member, nominal .. '|' .. attempt .. '||' .. tail)
  redis.call('ZADD', due, now + PUSH_BACK_MS, member)
end
local out = {now, -1, #orphans, #corrupt, #waiting, 0}
if #valid > 0 then
  local floor = now * 1000
  local last = redis.call('INCRBY', seq, #valid)
  if last - #valid < floor then
    last = floor + #valid
    redis.call('SET', seq, string.format('%d', last))
  end
  local token = last - #valid
  local deadline = now + lease_ms
  for _, item in ipairs(valid) do
    local member, fire, nominal, attempt, tail, plan =
      item[1], item[2], item[3], item[4], item[5], item[6]
    token = token + 1
    redis.call('ZREM', due, member)
    redis.call('HSET', occ, member,
      nominal .. '|' .. attempt .. '|' .. string.format('%d', token) .. '|' .. tail)
    redis.call('ZADD', lease, deadline, member)
    out[#out + 1] = member
    out[#out + 1] = fire
    out[#out + 1] = nominal
    out[#out + 1] = attempt
    out[#out + 1] = token
    out[#out + 1] = tail
    out[#out + 1] = plan
  end
end

local first = redis.call('ZRANGE', due, 0, 0, 'WITHSCORES')
if first[2] then
  out[2] = tonumber(first[2])
end
return out
