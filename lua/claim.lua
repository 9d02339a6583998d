--[[
  claim: take up to `limit` occurrences that are due by now out of `due`, lease them with a
  deadline and a fresh fencing token, and return them with their schedules.

  KEYS[1] due    ZSET  member -> fire time (ms)
  KEYS[2] lease  ZSET  member -> lease deadline (ms)
  KEYS[3] occ    HASH  member -> "nominal|attempt|token|fires" (absent: nominal = fire, 1, -, 0)
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  KEYS[5] seq    STRING fencing token counter
  ARGV[1] limit     (count) most occurrences to claim
  ARGV[2] lease_ms  (ms) how long the claim holds before the sweeper may reclaim it
  ARGV[3] now_ms    (ms, optional) overrides the server clock; tests only

  Returns {now_ms, next_due_ms (-1: none left), orphans, claimed...} where claimed is
  7 values per occurrence: member, fire_ms, nominal_ms, attempt, token, fires, schedule.
  An orphan is a due member whose schedule is gone (deleted meanwhile): it is dropped.
]]
local due, lease, occ, sched, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local limit = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])

local now
if ARGV[3] and ARGV[3] ~= '' then
  now = tonumber(ARGV[3])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
local out = {now, -1, 0}
local count = #items / 2
if count > 0 then
  local token = redis.call('INCRBY', seq, count) - count
  local deadline = now + lease_ms
  local orphans = 0
  for i = 1, #items, 2 do
    local member, fire = items[i], items[i + 1]
    redis.call('ZREM', due, member)
    local base = string.match(member, '^[^#]*')
    local plan = redis.call('HGET', sched, base)
    if not plan then
      redis.call('HDEL', occ, member)
      orphans = orphans + 1
    else
      token = token + 1
      local nominal, attempt, fires = fire, '1', '0'
      local current = redis.call('HGET', occ, member)
      if current then
        nominal, attempt, fires = string.match(current, '^([^|]*)|([^|]*)|[^|]*|([^|]*)$')
      end
      redis.call('HSET', occ, member, nominal .. '|' .. attempt .. '|' .. token .. '|' .. fires)
      redis.call('ZADD', lease, deadline, member)
      out[#out + 1] = member
      out[#out + 1] = fire
      out[#out + 1] = nominal
      out[#out + 1] = attempt
      out[#out + 1] = token
      out[#out + 1] = fires
      out[#out + 1] = plan
    end
  end
  out[3] = orphans
end

local first = redis.call('ZRANGE', due, 0, 0, 'WITHSCORES')
if first[2] then
  out[2] = tonumber(first[2])
end
return out
