-- plan_version(plan): the version a stored compact schedule starts with (shared.rules.compact),
-- nil for no value. The binary form begins with it as a msgpack integer, read alone; values
-- written by earlier versions are JSON, beginning '{"v":<version>'.
local function plan_version(plan)
  if not plan then
    return nil
  end
  if string.sub(plan, 1, 1) == '{' then
    return tonumber(string.match(plan, '^{"v":(%d+)'))
  end
  local _, version = cmsgpack.unpack_one(plan, 0)
  return tonumber(version)
end
