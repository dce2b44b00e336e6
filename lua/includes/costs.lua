-- What each caller's calls really cost of late (endpoint `cost_from`): a hash of its own per
-- endpoint (Keys.real_costs), user id -> "<moving average>,<last update, ms>", which the
-- claim reserves at least (claim-12.lua) and the acks update (ack-7.lua). A caller not heard
-- of for RC_IDLE_MS is forgotten (its next claim reserves the whole rate, as for any caller
-- unknown): each update also looks at RC_SWEEP more entries (HSCAN from a cursor kept in the
-- hash) and drops the idle ones, and the hash expires whole when no call settles for that
-- long. So a million callers seen once do not stay in Redis for ever, and they never sat in
-- the stats hash, which every /metrics scrape reads whole.

local RC_IDLE_MS, RC_SWEEP, RC_CURSOR = 3600000, 32, '#cursor'

-- The caller's recent real cost, or nil when unknown.
local function rc_read(rc, user)
  local v = redis.call('HGET', rc, user)
  return v and tonumber(string.match(v, '^[^,]+'))
end

local function rc_note(rc, user, value, now)
  local old = rc_read(rc, user)
  local avg = old and old * 0.9 + value * 0.1 or value
  redis.call('HSET', rc, user, string.format('%.1f,%d', avg, now))
  local scan = redis.call('HSCAN', rc, redis.call('HGET', rc, RC_CURSOR) or '0', 'COUNT',
    RC_SWEEP)
  local seen = scan[2]
  for i = 1, #seen, 2 do
    local at = tonumber(string.match(seen[i + 1], ',(%d+)$'))
    if seen[i] ~= RC_CURSOR and (not at or at < now - RC_IDLE_MS) then
      redis.call('HDEL', rc, seen[i])
    end
  end
  redis.call('HSET', rc, RC_CURSOR, scan[1])
  redis.call('PEXPIRE', rc, RC_IDLE_MS)
end
