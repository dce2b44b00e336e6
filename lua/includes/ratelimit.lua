-- Limiters. Each takes the limiter key, rate, interval (ms), the Redis time and a member unique
-- to this admission; it either records the admission and returns 0, or records nothing and
-- returns the exact milliseconds until an admission could succeed.  Include now.lua first (int).

-- A log of admissions, exact over any window of interval_ms. Members are unique per admission
-- (the seed used the millisecond, which folds two admissions in one millisecond into one).
local function rl_sliding_window(key, rate, interval, now, member)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - interval)
  local count = redis.call('ZCARD', key)
  if count < rate then
    redis.call('ZADD', key, now, member)
    redis.call('PEXPIRE', key, interval)
    return 0
  end
  -- One admission fits once count - rate + 1 calls have left the window (more than one when
  -- the rate was lowered): wait for the youngest of those, not merely the oldest call.
  local nth = redis.call('ZRANGE', key, count - rate, count - rate, 'WITHSCORES')
  return math.max(1, tonumber(nth[2]) + interval - now)
end

-- A counter per aligned window [k * interval, (k + 1) * interval), expiring when its window ends.
-- The value names its window ('k:count'), so a changed interval counts afresh at once instead of
-- inheriting a count that would hold until the old, longer window ran out.
local function rl_fixed_window(key, rate, interval, now, member)
  local window = int(math.floor(now / interval))
  local ends = (math.floor(now / interval) + 1) * interval
  local count = 0
  local stored = redis.call('GET', key)
  if stored then
    local w, c = string.match(stored, '^(%d+):(%d+)$')
    if w == window then count = tonumber(c) end
  end
  if count >= rate then
    return ends - now
  end
  redis.call('SET', key, window .. ':' .. (count + 1), 'PXAT', int(ends))
  return 0
end

-- GCRA in one key holding the theoretical arrival time: smooth pacing at rate/interval,
-- bursts of up to `rate` after a quiet spell.
local function rl_token_bucket(key, rate, interval, now, member)
  local emission = interval / rate
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new_tat = tat + emission
  local allow_at = new_tat - interval
  if allow_at > now then
    return math.max(1, math.ceil(allow_at - now))
  end
  redis.call('SET', key, string.format('%.3f', new_tat), 'PX', math.max(1, math.ceil(new_tat - now)))
  return 0
end

local limiters = {
  sliding_window = rl_sliding_window,
  fixed_window = rl_fixed_window,
  token_bucket = rl_token_bucket,
}

-- rate <= 0 means the endpoint has no rate limit.
local function rl_acquire(kind, key, rate, interval, now, member)
  if rate <= 0 then return 0 end
  return limiters[kind](key, rate, interval, now, member)
end
