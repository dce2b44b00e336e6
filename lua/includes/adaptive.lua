-- Adaptive concurrency (endpoint `concurrency: "adaptive"`): the cap the claim reads moves
-- between min_concurrency and max_concurrency, learnt from every call's latency and outcome,
-- by AIMD. Kept in the endpoint's stats hash, so every dispatcher admits to one figure:
--   alimit  the cap (a fraction; the claim admits floor(alimit))
--   abase   the upstream's unloaded latency (ms): the lowest seen, drifting slowly upwards
--   alat    recent latency (ms): a moving average of 1/ADAPT_EMA, so one call slowed on its
--           way (a busy dispatcher, a GC pause) is not read as the upstream's congestion
--   acut    when the cap was last cut (ms)
--   amin_c, amax_c  the bounds, written by the claim (so the ack needs no arguments of its own)
-- Recent latency over ADAPT_SLOW x abase (calls wait at the upstream: past its capacity), or
-- a call refused (429, 503) or timed out, cuts the cap (x0.8 when slow, x0.5 when refused), at
-- most once in half a base latency: the calls of one round report the same congestion, and cutting
-- for each would collapse the cap to the minimum at once. Any other success adds 1/alimit (one
-- more call a round of calls). At the minimum, the latency seen is the upstream's own, so the
-- base follows it there quickly: an upstream whose latency grew for good does not hold the cap
-- at the minimum (every call "slow" against a base it no longer has).

local ADAPT_SLOW, ADAPT_DRIFT, ADAPT_EMA = 1.25, 8192, 8

-- One call's sample for adaptive_update: its latency and whether the upstream turned it away.
local function adaptive_note(samples, status, code, ms)
  if not ms or ms < 0 then return end
  local refused = code == '429' or code == '503' or code == '504'
    or (status ~= 'completed' and code == '')
  if status == 'completed' or refused then samples[#samples + 1] = {ms, refused} end
end

local function adaptive_update(stats, now, samples)
  if #samples == 0 then return end
  local f = redis.call('HMGET', stats, 'alimit', 'abase', 'acut', 'amin_c', 'amax_c', 'alat')
  local minc, maxc = tonumber(f[4]), tonumber(f[5])
  if not maxc then return end  -- not adaptive
  local limit, base, cut = tonumber(f[1]) or minc, tonumber(f[2]), tonumber(f[3]) or 0
  local lat = tonumber(f[6])
  for _, s in ipairs(samples) do
    local ms, refused = s[1], s[2]
    if not refused then lat = lat and lat + (ms - lat) / ADAPT_EMA or ms end
    if refused or (base and lat > ADAPT_SLOW * base) then
      if now - cut >= (base or ms) / 2 then
        limit, cut = math.max(minc, limit * (refused and 0.5 or 0.8)), now
      end
    else
      limit = math.min(maxc, limit + 1 / limit)
    end
    if not refused then
      if not base or ms < base then base = ms
      elseif limit <= minc then base = base + (ms - base) / 8
      else base = base + (ms - base) / ADAPT_DRIFT end
    end
  end
  redis.call('HSET', stats, 'alimit', string.format('%.3f', limit), 'acut', cut)
  if lat then redis.call('HSET', stats, 'alat', string.format('%.1f', lat)) end
  if base then redis.call('HSET', stats, 'abase', string.format('%.1f', base)) end
end

-- The cap the claim admits to: the learnt one within the bounds (written here for the acks).
local function adaptive_cap(stats, minc, maxc)
  local f = redis.call('HMGET', stats, 'alimit', 'amin_c', 'amax_c')
  local limit = tonumber(f[1]) or minc
  if tonumber(f[2]) ~= minc or tonumber(f[3]) ~= maxc then
    limit = math.min(maxc, math.max(minc, limit))
    redis.call('HSET', stats, 'amin_c', minc, 'amax_c', maxc, 'alimit', limit)
  end
  return math.max(minc, math.floor(limit))
end
