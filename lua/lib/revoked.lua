-- An occurrence revoked while in flight leaves a marker `member!` -> "token|lease deadline" in
-- occ (upsert.lua, remove.lua), so that the new rotation's first occurrence waits for that
-- delivery (claim.lua).

-- keep_in_flight(lease, occ, member): leave the marker when `member` is in flight (leased, with
-- a token); otherwise an earlier marker stays as it is.
local function keep_in_flight(lease, occ, member)
  local deadline = redis.call('ZSCORE', lease, member)
  local current = redis.call('HGET', occ, member)
  local token = current and string.match(current, '^[^|]*|[^|]*|([^|]*)|')
  if deadline and token and token ~= '' then
    redis.call('HSET', occ, member .. '!', token .. '|' .. deadline)
  end
end

-- free_revoked(occ, member, token): a revoked occurrence that ends, or is found stale, frees the
-- new rotation waiting for it.
local function free_revoked(occ, member, token)
  local marker = redis.call('HGET', occ, member .. '!')
  if marker and string.match(marker, '^([^|]*)|') == token then
    redis.call('HDEL', occ, member .. '!')
  end
end
