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

local items = redis.call('ZRANGEBYSCORE', due, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)

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
