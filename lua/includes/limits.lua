-- Several limits per endpoint (docs/api.md `limits`), all checked in the one admission step.
-- Include now.lua and ratelimit.lua first.
--
-- A further limit's state lives beside the endpoint's other keys (same hash tag), named by what
-- it limits (Keys.further_limit): a changed limit counts afresh. The caller passes two keys a
-- limit after the script's fixed KEYS, in the order of the limits in ARGV: its state, then its
-- pace (Keys.further_pace; used by paced per-cost limits only).

-- Per-cost sliding limits over windows up to this long pace (lim_parse); a longer window (a
-- day's budget) stays spendable in bursts.
local LIM_PACE_MS = 60000

-- The further limits from argv[first]: a count, then kind, rate, interval, guard, per each;
-- their state and pace keys are keys[first_key], keys[first_key + 1], then the next limit's.
-- Their sliding windows widen by the whole guard; their entries too are moved to when the calls
-- really left (app/ratelimit/sent.py). A per-request one does not pace: paced at its own
-- emission, 2000/day would mean one call every 43 s, whatever the main limit (3/s) allows.
-- A per-cost sliding one of up to LIM_PACE_MS does, by units, as the main limit paces calls:
-- unpaced, each window's units left in one burst that reached the upstream spread over more
-- than the guard (bench/ratelimit.py, 200 units/s, two dispatchers: 25 windows over), and each
-- round through the log lost the claim's and the send's delay on top of the guard (0.95 of the
-- rate delivered); the pace keeps its own clock, so the delays do not add up.
local function lim_parse(argv, first, keys, first_key)
  local list = {}
  for i = 0, (tonumber(argv[first]) or 0) - 1 do
    local j = first + 1 + i * 5
    local kind, rate, interval = argv[j], tonumber(argv[j + 1]), tonumber(argv[j + 2])
    local l = {kind = kind, rate = rate, interval = interval, guard = tonumber(argv[j + 3]),
      per = argv[j + 4], key = keys[first_key + 2 * i], pace = keys[first_key + 2 * i + 1]}
    l.widen = l.guard
    if l.per == 'cost' and kind == 'sliding_window' then
      l.kind, l.paced = 'sliding_cost', interval <= LIM_PACE_MS
      -- Paced, it has no bursts left for the whole guard to cover: half, as the main log.
      if l.paced then l.widen = math.floor(l.guard / 2) end
    end
    list[#list + 1] = l
  end
  return list
end

local function lim_save(key)
  local v = redis.call('GET', key)
  if not v then return {key, false, 0} end
  return {key, v, redis.call('PTTL', key)}
end

-- What undoes an admission under `l`: the strings it may set, as they were; the entry it adds.
local function lim_before(l, member, amount)
  local saved = {key = l.key}
  if (l.main and l.kind ~= 'token_bucket') or l.paced then
    saved[1] = lim_save(l.pace)
  end
  if l.kind == 'sliding_window' then saved.zrem = member
  elseif l.kind == 'sliding_cost' then saved.zrem = member .. ':' .. amount
  else saved[#saved + 1] = lim_save(l.key) end
  return saved
end

local function lim_undo(saved)
  for _, s in ipairs(saved) do
    if not s[2] then redis.call('DEL', s[1])
    elseif s[3] > 0 then redis.call('SET', s[1], s[2], 'PX', s[3])
    else redis.call('SET', s[1], s[2]) end
  end
  if saved.zrem then redis.call('ZREM', saved.key, saved.zrem) end
end

-- A per-cost limit paced by units: `amount` units spend `amount` emissions of its pace. A
-- unit's emission spans the widened window's share (interval + widen) / rate: a pace of
-- interval / rate would fill the log faster than it empties, so the log would bind and each
-- call wait out its claim's and send's delays again, from a pace restarted late each time.
local function lim_paced(l, now, member, amount)
  local w, paced = rl_pace(l.pace, l.rate / amount, l.interval + l.widen, l.guard, now)
  if w > 0 then return w end
  w = limiters[l.kind](l.key, l.rate, l.interval, l.guard, now, member, amount, l.widen)
  if w == 0 then
    redis.call('SET', l.pace, string.format('%.3f', paced), 'PX', math.max(1, math.ceil(paced - now)))
  end
  return w
end

-- Admit one call under every limit, or under none: each limiter records as it admits, so when
-- any refuses, what the others recorded in this step is undone. Every limit is asked, so the
-- tightest (longest wait) names the retry time; it is returned second (for operators). A
-- per-cost limit spends `cost` units, at most its whole rate (a task costing more, after the
-- limit was lowered, still gets through alone). `dry`: only ask, undoing an admission too.
local function lim_acquire(limits, now, member, cost, dry)
  local undo, wait, binding = {}, 0, nil
  for _, l in ipairs(limits) do
    local amount = 1
    if l.per == 'cost' then amount = math.min(cost, l.rate) end
    local saved = lim_before(l, member, amount)
    local w
    if l.main then w = rl_acquire(l.kind, l.key, l.pace, l.rate, l.interval, l.guard, now, member)
    elseif l.paced then w = lim_paced(l, now, member, amount)
    else w = limiters[l.kind](l.key, l.rate, l.interval, l.guard, now, member, amount, l.widen) end
    if w > wait then binding = l end
    if w > 0 then wait = math.max(wait, w) else undo[#undo + 1] = saved end
  end
  if wait > 0 or dry then
    for _, saved in ipairs(undo) do lim_undo(saved) end
  end
  return wait, binding
end

-- How operators read the limit that binds (app/queue/stats.py): rate/interval/per, 'main' for
-- the endpoint's own rate.
local function lim_name(l)
  if not l or l.main then return 'main' end
  return int(l.rate) .. '/' .. int(l.interval) .. '/' .. l.per
end

-- Settle a per-cost admission (made at `started` under lease token `member`, `reserved` units)
-- to its real cost (at most the limit's rate): the difference is refunded, or spent, in the
-- state the admission went to, if it still counts there (a log entry out of the window, or a
-- fixed window since ended, has nothing left to settle).
local function lim_settle(l, member, reserved, real, started, now)
  if l.per ~= 'cost' then return end
  reserved = math.min(reserved, l.rate)  -- as lim_acquire spent it
  -- One settle charges at most the whole rate, one interval's worth: a misread figure
  -- (x-usage: 10^12) would push the pace, or a bucket's clock, centuries out.
  real = math.min(real, l.rate)
  local delta = real - reserved
  if delta == 0 then return end
  if l.kind == 'sliding_cost' then
    local old = member .. ':' .. reserved
    local score = redis.call('ZSCORE', l.key, old)
    if not score then return end
    redis.call('ZREM', l.key, old)
    redis.call('ZADD', l.key, score, member .. ':' .. int(real))
    if l.paced then  -- its pace too: the units it did not spend pace nobody
      local tat = tonumber(redis.call('GET', l.pace))
      if tat then
        if delta > 0 then tat = math.max(tat, now) end
        tat = tat + delta * (l.interval + l.widen) / l.rate
        if tat <= now then redis.call('DEL', l.pace)
        else redis.call('SET', l.pace, string.format('%.3f', tat), 'PX', math.ceil(tat - now)) end
      end
    end
  elseif l.kind == 'fixed_window' then
    local stored = redis.call('GET', l.key)
    local w, c = string.match(stored or '', '^(%d+):(%d+)$')
    if w ~= int(math.floor(started / l.interval)) then return end
    redis.call('SET', l.key, w .. ':' .. int(math.max(0, tonumber(c) + delta)), 'KEEPTTL')
  else
    local emission = rl_tb_emission(l.rate, l.interval, l.guard)
    local tat = tonumber(redis.call('GET', l.key) or '0')
    if delta > 0 then tat = math.max(tat, now) end
    tat = tat + delta * emission
    if tat <= now then redis.call('DEL', l.key)
    else redis.call('SET', l.key, string.format('%.3f', tat), 'PX', math.ceil(tat - now)) end
  end
end

-- Settle the per-cost admissions of the task in hash `task` (lease token `member`) to its real
-- cost `real` (nil: not read, nothing to settle), under the further limits of argv[first] with
-- their keys from keys[first_key] (lim_parse): what ack and retry do when a call ends.
local function lim_settle_task(task, member, real, argv, first, keys, first_key, now)
  if not real then return end
  local f = redis.call('HMGET', task, 'cost', 'started_at')
  for _, l in ipairs(lim_parse(argv, first, keys, first_key)) do
    lim_settle(l, member, tonumber(f[1]) or 1, real, tonumber(f[2]) or now, now)
  end
end
