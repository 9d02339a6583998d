-- plan_version(plan): the version a stored compact schedule starts with (shared.rules.compact),
-- nil for no value. The binary form begins with it as a msgpack integer, read alone; values
-- written by earlier versions are JSON, beginning '{"v":<version>'.
--
-- plan_is_json(plan): whether a value is in the JSON form. Two bytes, not one: msgpack packs
-- the version 123 as the single byte '{', but a binary value's second byte is its map's
-- header (0x80-0x8f, 0xde or 0xdf), never '"'.
local function plan_is_json(plan)
  return string.sub(plan, 1, 2) == '{"'
end

local function plan_version(plan)
  if not plan then
    return nil
  end
  if plan_is_json(plan) then
    return tonumber(string.match(plan, '^{"v":(%d+)'))
  end
  local _, version = cmsgpack.unpack_one(plan, 0)
  return tonumber(version)
end
