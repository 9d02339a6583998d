-- clock_ms(given): the time in ms: `given` when a test passes one (neither nil nor ''), else
-- the Redis clock, never a host's, so every dispatcher, executor and sweeper reads one time.
local function clock_ms(given)
  if given and given ~= '' then
    return tonumber(given)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
