-- Pauses an upstream asked for (app/queue/signals.py). Field `upause` of the endpoint's stats
-- hash holds until when (ms, Redis clock) it admits nothing, on every dispatcher (a field, so a
-- scrape reads it with the counters); once that has passed, one
-- probe call goes first (`<prefix>:{e}:probe` holds its lease token and expires with its lease),
-- and only its success lifts the pause. The caller passes both keys (stats, probe) in KEYS.

local function upstream_pause(stats, probe, now, ms)
  local untl = now + ms
  local current = tonumber(redis.call('HGET', stats, 'upause'))
  if not current or untl > current then redis.call('HSET', stats, 'upause', untl) end
  redis.call('DEL', probe)
end

-- A call ended with no pause asked for: if it was the probe, a success reopens the endpoint,
-- and a failure lets the next claim send another probe.
local function upstream_call_ended(stats, probe, token, ok)
  if redis.call('GET', probe) == token then
    redis.call('DEL', probe)
    if ok then redis.call('HDEL', stats, 'upause') end
  end
end

-- What the upstream said remains before its reset (budget-2.lua): fields `ubudget` (calls the
-- claim may still admit) and `ubudget_until` (its reset, ms) of the stats hash. Two answers
-- naming the same reset (within UPSTREAM_SAME_RESET_MS) are news of one window: the lower count
-- is the later one. A later reset is a new window, whose count replaces the old.
local UPSTREAM_SAME_RESET_MS = 100

local function upstream_budget_told(stats, now, budget, untl)
  local f = redis.call('HMGET', stats, 'ubudget', 'ubudget_until')
  local old, old_until = tonumber(f[1]), tonumber(f[2])
  if old and old_until and old_until > now then
    if untl < old_until - UPSTREAM_SAME_RESET_MS then return end  -- older news, late
    if untl <= old_until + UPSTREAM_SAME_RESET_MS then budget = math.min(budget, old) end
  end
  redis.call('HSET', stats, 'ubudget', math.max(0, budget), 'ubudget_until', untl)
end

-- How many calls the claim may admit before the upstream's reset (nil: no count known), and
-- the ms until that reset.
local function upstream_budget(stats, now)
  local f = redis.call('HMGET', stats, 'ubudget', 'ubudget_until')
  local budget, untl = tonumber(f[1]), tonumber(f[2])
  if not budget or not untl or untl <= now then return nil, 0 end
  return budget, untl - now
end
