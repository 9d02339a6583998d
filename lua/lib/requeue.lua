-- An occurrence taken back from whoever held it (a dispatcher that could not publish it, an
-- executor that parks it behind a closed rate gate) goes back into `due` with its attempt
-- unchanged and no token, so it holds no lease meanwhile.

-- occ_fields(current): nominal, attempt, token, tail ("fires[|flags]") of an occ value (all nil
-- when there is none).
local function occ_fields(current)
  if not current then
    return nil, nil, nil, nil
  end
  return string.match(current, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
end

-- requeue(due, lease, occ, member, nominal, attempt, tail, at, catch_up): into `due` at `at`.
-- `catch_up` flags it 'c': its misfire policy already let it through, so it is delivered late,
-- not judged (and perhaps dropped) again.
local function requeue(due, lease, occ, member, nominal, attempt, tail, at, catch_up)
  if catch_up then
    local fires, flags = string.match(tail, '^([^|]*)|?(.*)$')
    if not string.find(flags, 'c', 1, true) then
      flags = flags .. 'c'
    end
    tail = fires .. '|' .. flags
  end
  redis.call('ZREM', lease, member)
  redis.call('HSET', occ, member, nominal .. '|' .. attempt .. '||' .. tail)
  redis.call('ZADD', due, at, member)
end
