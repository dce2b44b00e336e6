-- Limiters. Each takes the limiter key, rate, interval (ms), a guard (ms), the Redis time, a
-- member unique to this admission and, optionally, the amount it spends (a per-cost limit's
-- units, default 1) and how far a sliding window widens (default guard / 2); it either records
-- the admission and returns 0, or records nothing and returns the exact milliseconds until an
-- admission could succeed.
-- Include now.lua first (int).
--
-- The guard is a margin for the jitter between an admission (in the claim script) and the
-- moment the upstream sees the call: a call that arrives up to `guard` ms late must still keep
-- every window of the upstream within the limit.

-- A log of admissions, exact over any window of interval + guard / 2. Members are unique per
-- admission (the seed used the millisecond, which folds two admissions in one into one).
-- Half the guard: the dispatcher moves each entry to when its call really left (sent-1.lua),
-- so only the way from there to the upstream is left to cover.
local function rl_sliding_window(key, rate, interval, guard, now, member, amount, widen)
  local window = interval + (widen or math.floor(guard / 2))
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local count = redis.call('ZCARD', key)
  if count < rate then
    redis.call('ZADD', key, now, member)
    redis.call('PEXPIRE', key, window)
    return 0
  end
  -- One admission fits once count - rate + 1 calls have left the window (more than one when
  -- the rate was lowered): wait for the youngest of those, not merely the oldest call.
  local nth = redis.call('ZRANGE', key, count - rate, count - rate, 'WITHSCORES')
  return math.max(1, tonumber(nth[2]) + window - now)
end

-- The same log for a per-cost limit: each member ends in ':<units>' and the window holds at
-- most `rate` units. Its entries move to the send time as the main log's do (sent-1.lua, by
-- the same name).
local function rl_sliding_cost(key, rate, interval, guard, now, member, amount, widen)
  local window = interval + widen
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local entries = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  local units = {}
  local sum = 0
  for i = 1, #entries, 2 do
    units[i] = tonumber(string.match(entries[i], ':(%d+)$')) or 0
    sum = sum + units[i]
  end
  if sum + amount <= rate then
    redis.call('ZADD', key, now, member .. ':' .. amount)
    redis.call('PEXPIRE', key, window)
    return 0
  end
  -- It fits once enough of the oldest units have left the window.
  for i = 1, #entries, 2 do
    sum = sum - units[i]
    if sum + amount <= rate then return math.max(1, tonumber(entries[i + 1]) + window - now) end
  end
  return window
end

-- A counter per aligned window [k * interval, (k + 1) * interval), expiring when its window ends.
-- The value names its window ('k:count'), so a changed interval counts afresh at once instead of
-- inheriting a count that would hold until the old, longer window ran out.  Nothing is admitted
-- in a window's last `guard` ms: such a call could reach the upstream in the next window.
local function rl_fixed_window(key, rate, interval, guard, now, member, amount)
  amount = amount or 1
  local window = int(math.floor(now / interval))
  local ends = (math.floor(now / interval) + 1) * interval
  if now >= ends - guard then
    return ends - now
  end
  local count = 0
  local stored = redis.call('GET', key)
  if stored then
    local w, c = string.match(stored, '^(%d+):(%d+)$')
    if w == window then count = tonumber(c) end
  end
  if count + amount > rate then
    return ends - now
  end
  redis.call('SET', key, window .. ':' .. (count + amount), 'PXAT', int(ends))
  return 0
end

-- GCRA in one key holding the theoretical arrival time: smooth pacing at rate/interval, bursts
-- of up to `rate` after a quiet spell.  The guard comes off the burst tolerance (a late call
-- must not turn a full burst into one over the bound); with no tolerance left (rate 1), it
-- spaces the calls instead.
local function rl_tb_emission(rate, interval, guard)
  local emission = interval / rate
  local tolerance = interval - emission - guard
  if tolerance < 0 then emission, tolerance = emission - tolerance, 0 end
  return emission, tolerance
end

-- An amount over 1 spends `amount` emissions; a full bucket (idle) admits any amount up to the
-- rate, which the guard's share of the tolerance would otherwise refuse for ever.
local function rl_token_bucket(key, rate, interval, guard, now, member, amount)
  amount = amount or 1
  local emission, tolerance = rl_tb_emission(rate, interval, guard)
  local tat = tonumber(redis.call('GET', key) or '0')
  local idle = tat <= now
  if tat < now then tat = now end
  local new_tat = tat + emission * amount
  local allow_at = new_tat - emission - tolerance
  if allow_at > now and not (idle and amount > 1) then
    return math.max(1, math.ceil(allow_at - now))
  end
  redis.call('SET', key, string.format('%.3f', new_tat), 'PX', math.max(1, math.ceil(new_tat - now)))
  return 0
end

local limiters = {
  sliding_window = rl_sliding_window,
  fixed_window = rl_fixed_window,
  token_bucket = rl_token_bucket,
  sliding_cost = rl_sliding_cost,
}

-- Pacing for the window limiters: at most one call per interval / rate, with up to `guard` ms
-- of catch-up.  A window may admit all its calls at once, but one process pushes such a batch
-- out over tens or hundreds of ms, so the upstream would see the late part of one window's
-- batch together with the next window's; paced calls leave as they are admitted.  (A token
-- bucket paces itself, and its bursts are its point.)  Returns the wait (ms), and when 0 the
-- state to record if the limiter admits.
local function rl_pace(key, rate, interval, guard, now)
  local emission = interval / rate
  local stored = redis.call('GET', key)
  -- The catch-up is for claims that come late while the endpoint is being paced. An idle
  -- endpoint (no state) starts without it: a burst at once from every dispatcher, each call
  -- opening a connection, reached the upstream tens of ms late and crowded the first window.
  local tat = now + guard
  if stored then tat = math.max(tonumber(stored), now) end
  if tat - now > guard then return math.max(1, math.ceil(tat - now - guard)), nil end
  return 0, tat + emission
end

-- rate <= 0 means the endpoint has no rate limit.  The pacing state `pace_key` lives beside the
-- limiter's (same hash tag) and names the rate it paces, `<key>:pace:<rate>/<interval>`
-- (Keys.pace, passed by the caller), so a changed limit paces afresh at once.
local function rl_acquire(kind, key, pace_key, rate, interval, guard, now, member)
  if rate <= 0 then return 0 end
  local paced = nil
  if kind ~= 'token_bucket' then
    local wait
    wait, paced = rl_pace(pace_key, rate, interval, guard, now)
    if wait > 0 then return wait end
  end
  local wait = limiters[kind](key, rate, interval, guard, now, member)
  if wait == 0 and paced then
    redis.call('SET', pace_key, string.format('%.3f', paced), 'PX', math.max(1, math.ceil(paced - now)))
  end
  return wait
end
