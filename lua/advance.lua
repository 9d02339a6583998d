--[[
  advance: the position of a shard of the index (invariant 9). A position counts the
  transactions of PostgreSQL that changed a schedule of the shard; `pos` is the last one whose
  writes this index holds, all earlier ones included. Writes land out of order (two group
  commits write concurrently), so a position past a gap waits in `ahead` until the gap closes.
  Called after the writes of a position (same slot: a replica that has this call has them).

  KEYS[1] pos    STRING the last position applied with every earlier one
  KEYS[2] ahead  ZSET   positions applied past a gap (member and score: the position)
  ARGV[1] mode   'note'  : ARGV[2] was applied (the intake, after its index writes)
                 'floor' : every position up to ARGV[2] is applied (the sweeper, after
                           replaying the rows PostgreSQL had committed up to it)
                 'start' : as 'floor', only when the shard has no position yet (a rebuild of
                           an empty index, from a read of PostgreSQL after ARGV[2])
  ARGV[2] position

  Returns the shard's position after the call.
]]
local pos_key, ahead_key = KEYS[1], KEYS[2]
local mode, position = ARGV[1], tonumber(ARGV[2])
local held = redis.call('GET', pos_key)
local current = tonumber(held or '0')

if mode == 'note' then
  if position > current + 1 then
    redis.call('ZADD', ahead_key, position, position)
    return current
  end
  current = math.max(current, position)
elseif mode == 'floor' or (mode == 'start' and not held) then
  current = math.max(current, position)
end

-- Positions waiting past the gap that is now closed move the position on.
local waiting = redis.call('ZRANGEBYSCORE', ahead_key, '-inf', '+inf')
for _, value in ipairs(waiting) do
  local next_one = tonumber(value)
  if next_one <= current then
    redis.call('ZREM', ahead_key, value)
  elseif next_one == current + 1 then
    current = next_one
    redis.call('ZREM', ahead_key, value)
  else
    break
  end
end
if held == false or tonumber(held) ~= current then
  redis.call('SET', pos_key, string.format('%d', current))
end
return current
