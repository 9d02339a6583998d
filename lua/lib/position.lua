-- Positions of a shard of the index (invariant 9; see advance.lua for the keys).

-- position_applied(pos_key, ahead_key, position): whether the index holds the writes of this
-- position (applied with every earlier one, or past a gap, waiting in `ahead`).
local function position_applied(pos_key, ahead_key, position)
  if tonumber(redis.call('GET', pos_key) or '0') >= position then
    return true
  end
  return redis.call('ZSCORE', ahead_key, position) and true or false
end

-- position_advance(pos_key, ahead_key, mode, position): record a position ('note', 'floor' or
-- 'start', as advance.lua says); returns the shard's position after.
local function position_advance(pos_key, ahead_key, mode, position)
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
end
