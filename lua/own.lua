--[[
  own: a dispatcher's lease on one shard (which dispatcher claims from it). Leases only spread
  the claiming work: claim.lua stays atomic, so two owners could never double a fire.

  KEYS[1] owner  STRING dispatcher id holding the shard (expires by itself)
  ARGV[1] dispatcher_id
  ARGV[2] ttl_ms   (ms) how long the lease lasts without renewal
  ARGV[3] mode     'acquire' (take it if free, or renew it if ours) | 'renew' (only if ours)
                   | 'release' (give it up if ours)

  Returns 1 when the shard is this dispatcher's after the call, 0 when it is not.
]]
local owner_key = KEYS[1]
local me, ttl, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local holder = redis.call('GET', owner_key)

if mode == 'release' then
  if holder == me then
    redis.call('DEL', owner_key)
  end
  return 0
end
if holder == me then
  redis.call('PEXPIRE', owner_key, ttl)
  return 1
end
if mode == 'acquire' and not holder then
  redis.call('SET', owner_key, me, 'PX', ttl)
  return 1
end
return 0
