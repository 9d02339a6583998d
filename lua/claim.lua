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
  KEYS[4] sched  HASH  ns/id  -> compact schedule
  KEYS[5] seq    STRING fencing token counter
  ARGV[1] limit     (count) most occurrences to claim
  ARGV[2] lease_ms  (ms) how long the claim holds before the sweeper may reclaim it
  ARGV[3] now_ms    (ms, optional) overrides the server clock; tests only

  Returns {now_ms, next_due_ms (-1: none left), orphans, corrupt, claimed...} where claimed is
  7 values per occurrence: member, fire_ms, nominal_ms, attempt, token, tail, schedule
  (tail: "fires" or "fires|flags"). An orphan is a due member whose schedule is gone (deleted
  meanwhile): it is dropped.
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

-- Read and check everything first.
local valid, orphans, corrupt = {}, {}, {}
for i = 1, #items, 2 do
  local member, fire = items[i], items[i + 1]
  local plan = redis.call('HGET', sched, string.match(member, '^[^#]*'))
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
    if ok then
      valid[#valid + 1] = {member, fire, nominal, attempt, tail, plan}
    else
      corrupt[#corrupt + 1] = member
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
local out = {now, -1, #orphans, #corrupt}
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
