--[[
  failures: count each schedule's consecutive occurrences ended dead, for pause_after_failures.
  A dead occurrence adds one; a success (or the pause itself) clears the count. Only schedules
  that set pause_after_failures are counted, so an idle schedule costs no memory here.

  KEYS[1] fails  HASH  ns/id -> consecutive occurrences ended dead
  ARGV pairs: member (ns/id), outcome ('dead' : add one; 'clear' : forget the count)

  Returns one count per pair: the consecutive dead occurrences after this call (0 if cleared).
]]
local fails = KEYS[1]
local results = {}
for i = 1, #ARGV, 2 do
  local member, outcome = ARGV[i], ARGV[i + 1]
  if outcome == 'dead' then
    results[#results + 1] = redis.call('HINCRBY', fails, member, 1)
  else
    redis.call('HDEL', fails, member)
    results[#results + 1] = 0
  end
end
return results
