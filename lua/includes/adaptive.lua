-- Adaptive concurrency (endpoint `concurrency: "adaptive"`): the cap the claim reads moves
-- between min_concurrency and max_concurrency, learnt from every call's latency and outcome.
-- Kept in the endpoint's stats hash, so every dispatcher admits to one figure:
--   alimit  the cap (a fraction; the claim admits floor(alimit))
--   abase   the upstream's unloaded latency (ms): the lowest mean of a round, drifting slowly
--           upwards
--   awin    when the current round began (ms, Redis clock): the last decision
--   asum, acnt  the latencies of the round's calls so far (sum, count)
--   aover   1 when the last round was over the tolerance (and held the cap)
--   amin_c, amax_c  the bounds, written by the claim (so the ack needs no arguments of its own)
-- The controller decides once a round, on the calls claimed since the last decision: a call
-- claimed before it ran under the old cap, and counting it again is what cut a cap twice for
-- one congestion (a round's calls report the same overload) and left it far below capacity.
-- Once half a cap of such calls (ADAPT_ROUND at most) answered, g = their mean latency / abase:
--   g >= ADAPT_TOL  calls queue at the upstream (it is past its capacity), if the round
--                   before was over it too: the cap goes to cap x ADAPT_AIM / g (at least half
--                   the cap), where latency would be AIM x base if it grows with the calls in
--                   flight, as a queue's does (a first such round only holds the cap);
--   g <  ADAPT_TOL  and the cap in use (ADAPT_USED of it in flight), the cap grows: to cap x
--                   ADAPT_TOL / g while g >= ADAPT_AIM (what is left of the tolerance), else
--                   by that factor (ADAPT_GROW at most) and one call at least.
-- So the cap settles a little past the upstream's capacity, between AIM and TOL x the base
-- latency: the upstream never idles in the gap between one call's end and the next call's
-- arrival, and latency stays within TOL x its own. A refusal (429, 503, 504) or a timeout of
-- such a call halves the cap at once and starts a new round. The base is the lowest round
-- mean seen and drifts up slowly; at the minimum, the latency seen is the upstream's own, so
-- the base follows it there quickly: an upstream whose latency grew for good does not hold
-- the cap at the minimum (every call "slow" against a base it no longer has).

local ADAPT_TOL, ADAPT_AIM, ADAPT_GROW, ADAPT_ROUND, ADAPT_DRIFT = 1.3, 1.15, 1.5, 16, 4096
local ADAPT_USED = 0.75

-- One call's sample for adaptive_update: its latency, whether the upstream turned it away,
-- and when it was claimed (ms; 0 = unknown).
local function adaptive_note(samples, status, code, ms, started)
  if not ms or ms < 0 then return end
  local refused = code == '429' or code == '503' or code == '504'
    or (status ~= 'completed' and code == '')
  if status == 'completed' or refused then
    samples[#samples + 1] = {ms, refused, started or 0}
  end
end

-- The cap after a round whose calls took g x the base latency, and whether that round was
-- over the tolerance. A first round over it holds the cap: one slow round is as often the
-- dispatcher's own stall (a busy machine delays every answer it reads for a while) as the
-- upstream's queue, and a stall passes; a second one in a row cuts.
local function adaptive_decide(limit, g, busy, over)
  if g >= ADAPT_TOL then
    if not over then return limit, true end
    return limit * math.max(0.5, ADAPT_AIM / g), false
  end
  if not busy then return limit, false end  -- calls it does not make tell nothing of more
  -- Near the tolerance, only what is left of it; well below, one call a round at least.
  if g >= ADAPT_AIM then return limit * ADAPT_TOL / g, false end
  return limit + math.max(1, limit * (math.min(ADAPT_GROW, ADAPT_TOL / g) - 1)), false
end

-- The base latency after a round whose calls took `ms` on average: the lowest round seen,
-- drifting up slowly, and quickly at the minimum cap. A round's mean, not one call's latency:
-- a call slowed on its way (a busy dispatcher, a GC pause) only ever adds to it, so the
-- fastest single call is a base that ordinary rounds never meet, and the cap would be cut for
-- the dispatcher's own delays.
local function adaptive_base(base, ms, at_min)
  if not base or ms < base then return ms end
  if at_min then return base + (ms - base) / 8 end
  return base + (ms - base) / ADAPT_DRIFT
end

-- Fold one ack's samples in; `active` the endpoint's in-flight set (the calls just ended are
-- out of it already).
local function adaptive_update(stats, now, samples, active)
  if #samples == 0 then return end
  local f = redis.call('HMGET', stats, 'alimit', 'abase', 'awin', 'amin_c', 'amax_c', 'asum',
    'acnt', 'aover')
  local minc, maxc = tonumber(f[4]), tonumber(f[5])
  if not maxc then return end  -- not adaptive
  local limit, base, win = tonumber(f[1]) or minc, tonumber(f[2]), tonumber(f[3]) or 0
  local sum, cnt, over = tonumber(f[6]) or 0, tonumber(f[7]) or 0, f[8] == '1'
  -- The cap in use: a dispatcher that lags behind it (a busy machine) sends fewer calls, whose
  -- latency says nothing of the cap's.
  local busy = redis.call('ZCARD', active) + #samples >= math.floor(limit) * ADAPT_USED
  for _, s in ipairs(samples) do
    local ms, refused, started = s[1], s[2], s[3]
    if started >= win then  -- claimed under the current cap
      if refused then
        limit, win, sum, cnt, over = math.max(minc, limit * 0.5), now, 0, 0, false
      else
        sum, cnt = sum + ms, cnt + 1
        if cnt >= math.max(1, math.min(ADAPT_ROUND, math.floor(limit / 2))) then
          -- At the minimum it admits: the cap in use (a limit of 1.9 admits 1), not the figure.
          base = adaptive_base(base, sum / cnt, math.floor(limit) <= minc)
          limit, over = adaptive_decide(limit, sum / cnt / base, busy, over)
          limit = math.min(maxc, math.max(minc, limit))
          win, sum, cnt = now, 0, 0
        end
      end
    end
  end
  redis.call('HSET', stats, 'alimit', string.format('%.3f', limit), 'awin', win, 'asum', sum,
    'acnt', cnt, 'aover', over and 1 or 0)
  -- Not rounded to 0.1 ms: the slow drift moves it by less a round (1/4096 of the gap).
  if base then redis.call('HSET', stats, 'abase', string.format('%.4f', base)) end
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
