--[[ Claim up to N tasks of one endpoint: limiter, concurrency cap, pop and lease in one step.
KEYS[1] queue    KEYS[2] active    KEYS[3] limiter state    KEYS[4] wake
KEYS[5] delayed  ZSet of limited endpoints; score = when the limiter admits again
KEYS[6] retry    KEYS[7] stats    KEYS[8] deadlines    KEYS[9] probe (upstream.lua)
KEYS[10] outbox  KEYS[11] hooks (lifecycle.lua)    KEYS[12] the limiter's pacing state
KEYS[13..] the further limits' state and pace keys, two per limit of ARGV[12..], in that order
ARGV[1] endpoint id         ARGV[2] N (free capacity of the caller)
ARGV[3] max concurrency (0 = none)    ARGV[4] lease (ms)
ARGV[5] limiter kind        ARGV[6] rate (0 = none)    ARGV[7] interval (ms)
ARGV[8] task key prefix (same hash tag as KEYS, so the script stays in one slot)
ARGV[9] lease token prefix (unique per call)    ARGV[10] permit TTL (ms) for online tasks
ARGV[11] limiter guard (ms), see ratelimit.lua
ARGV[12] how many further limits (docs/api.md `limits`; 0 or absent = none), then kind, rate,
interval (ms), guard (ms), per ('request' | 'cost') each: checked with the main one, all or
none admitting (limits.lua); their state and pace keys are KEYS[13..]. A per-cost limit spends
the task's `cost` field.
After the further limits (ARGV[12] then, 0 when there are none): the starvation bound (ms; 0 or
absent = none: strict priority), and with one, the arrival index (Keys.arrivals) after the
limits' keys: a task that has waited longer is claimed first (starvation.lua); then the minimum
concurrency of an adaptive endpoint (0 or absent = fixed: ARGV[3] is the cap), whose cap is
then the learnt one (adaptive.lua), ARGV[3] its maximum; then '1' when the endpoint reads
real costs (cost_from): a per-cost admission then reserves at least what the caller's calls
really cost of late (the acks' moving average in Keys.real_costs, costs.lua: its key comes after
the limits' keys and the arrival index), and the whole rate while that is unknown, so a caller who declares less than it spends cannot overrun the limit with
calls admitted before their acks settle them. The amount reserved is written to the task's
`cost`, which its settle reads. Then '0' when the endpoint ignores its upstream's signals
(`honor_upstream_limits` off): a pause or budget asked for before holds nothing then (an
operator turning it off moves the line at once, whatever a call begun before still reports).
Last, optionally, `only`: a task id, for the API process that
submitted it first in line (submit-11.lua's ARGV[13], a proxied request) and claims it itself,
N = 1: claimed only if it is the first the rules would claim; whatever it leaves to the
dispatchers is theirs as after any claim (more behind it or another first: the wake marker the
submit did not set; limited: KEYS[5]; full: the next ack's wake).
An endpoint its upstream paused (upstream.lua) is 'limited' until then, then claims one probe;
one whose upstream said how many calls remain before its reset (budget-2.lua) claims no more
than that until then.
Returns {state, wait ms, now, then per claim: id, token, attempts, type, method, url, headers,
query, body, cost (what it spent of per-cost limits, uncapped)}; state is
'more' (N reached, work remains), 'empty', 'full' (concurrency cap) or 'limited' (retry in wait ms).
Task ids whose hash has expired are dropped from the queue on the way; tasks past their
pending deadline are expired (lifecycle.lua).
Tasks whose retry back-off is over (retry-8.lua, KEYS[6]) go back in line first, with their original score; the earliest one not yet due stays scheduled in
KEYS[5].
Task hashes of ids read here are built from ARGV[8] (prefix), same hash tag.
A proxied request (type 'proxy') names the marker of the API process holding its caller
(fields `owner`, `owner_ms`: app/queue/owners.py). Older than `owner_ms` with its marker gone,
it holds the line ('limited') until two fifths of `owner_ms` (2 s at least) after a claim
first saw that (the time a live process has to write it again after an outage), then ends
'failed', never admitted. Admitted by a claim not its own, its lease is `owner_ms` (but
3 s at least) at most, until its process renews it. The marker's name comes from the task hash, not KEYS: the endpoint's tag, one slot.
]]
--@include now.lua
--@include ratelimit.lua
--@include lifecycle.lua
--@include stats.lua
--@include upstream.lua
--@include events.lua
--@include limits.lua
--@include starvation.lua
--@include adaptive.lua
--@include costs.lua

-- Since when (ms) the marker `owner` of a proxied request's API process is known gone
-- (app/queue/owners.py); nil while it is there. The first claim to miss it writes the time down
-- in its place, which the process's next write replaces.
local function owner_gone(owner, now)
  local mark = redis.call('GET', owner)
  if not mark then
    redis.call('SET', owner, 'gone:' .. now, 'PX', 86400000)  -- a day: the process is gone
    return now
  end
  if string.sub(mark, 1, 5) == 'gone:' then return tonumber(string.sub(mark, 6)) end
  return nil
end

-- How long a lapsed marker may take to come back: two of its process's renewals, 2 s at least
-- (a process's Redis client reconnecting after an outage).
local function owner_settle(ttl)
  return math.max(2000, math.floor(ttl * 2 / 5))
end

local nlim = tonumber(ARGV[12]) or 0
local only = ARGV[17 + 5 * nlim]
if only == '' then only = nil end
-- Sent with its submit whatever its place (one round trip): not first in line, the submit
-- woke the dispatchers, and this run has nothing to do.
if only and redis.call('ZRANK', KEYS[1], only) ~= 0 then return {'more', 0, 0} end

redis.call('ZREM', KEYS[5], ARGV[1])  -- this attempt consumes any scheduled retry

local endpoint, n, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local lease, kind, rate, interval = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local prefix, token_prefix, permit_ttl = ARGV[8], ARGV[9], tonumber(ARGV[10])
local guard = tonumber(ARGV[11])
local bound = tonumber(ARGV[13 + 5 * nlim]) or 0  -- starvation.lua
local arrivals = bound > 0 and KEYS[13 + 2 * nlim] or nil  -- then costs.lua's key
local min_cap = tonumber(ARGV[14 + 5 * nlim]) or 0  -- adaptive.lua
-- With further limits, the main one is checked among them (undone if another refuses).
local limits = lim_parse(ARGV, 12, KEYS, 13)
local settles = ARGV[15 + 5 * nlim] == '1'  -- reserve at least real costs (see above)
local honors = ARGV[16 + 5 * nlim] ~= '0'  -- its upstream's pauses and budgets (see above)
local rc = settles and KEYS[13 + 2 * nlim + (bound > 0 and 1 or 0)] or nil
local whole = 1  -- the largest per-cost rate: what a caller of unknown costs reserves
for _, l in ipairs(limits) do
  if l.per == 'cost' and l.rate > whole then whole = l.rate end
end
if #limits > 0 and rate > 0 then
  table.insert(limits, 1, {kind = kind, key = KEYS[3], pace = KEYS[12], rate = rate,
    interval = interval, guard = guard, per = 'request', main = true})
end
local now = now_ms()
local retry = KEYS[6]
for _, id in ipairs(redis.call('ZRANGEBYSCORE', retry, '-inf', now, 'LIMIT', 0, 1000)) do
  local score = redis.call('HGET', prefix .. id, 'score')
  if score then
    redis.call('ZADD', KEYS[1], score, id)
    redis.call('HDEL', prefix .. id, 'retry_at')
    starve_back(arrivals, prefix .. id, id)
  end
  redis.call('ZREM', retry, id)
end
local out = {'more', 0, now}
local stats, deadlines, probe = KEYS[7], KEYS[8], KEYS[9]
local claimed = 0
local limited_by = 'upstream'  -- what holds the line when 'limited' (operators, stats.py)
local settling = false  -- 'limited' by a proxied request's lapsed marker, not by a limit
local changed = {}  -- ids whose status this run changes, published once at the end

-- Paused by its upstream (upstream.lua): nothing until then, then one probe at a time.
local paused, probing = honors and tonumber(redis.call('HGET', stats, 'upause')), false
if paused and paused > now then
  out[1], out[2], n = 'limited', paused - now, 0
elseif paused and redis.call('EXISTS', probe) == 1 then
  out[1], n = 'full', 0  -- the probe's ending wakes it
elseif paused then
  probing, n = true, 1
end
-- No more calls than the upstream said remain before its reset (upstream.lua).
local budget, budget_wait = nil, 0
if honors then budget, budget_wait = upstream_budget(stats, now)
elseif redis.call('HGET', stats, 'limited_by') == 'upstream' then
  -- What a pause or budget held it till, for the estimates and operators: held no more.
  redis.call('HDEL', stats, 'limited_until', 'limited_by')
end
if budget and n > 0 then
  if budget <= 0 then out[1], out[2], n = 'limited', budget_wait, 0
  else n = math.min(n, budget) end
end

if min_cap > 0 then cap = adaptive_cap(stats, min_cap, cap) end
-- Its active count, read once and kept as this run adds to it (no ZCARD per task).
local active = cap > 0 and redis.call('ZCARD', KEYS[2]) or 0
local waits = {}  -- queue_wait_ms observations (stats_tally), written once at the end
-- The head of the line, read a batch at a time (not one ZRANGE per task). Each task leaves
-- the queue as it is claimed (a claim failing half-way leaves every task either claimed or
-- queued as it was), so the next batch is read from the front again.
local heads, h = {}, 1
-- Tasks past the starvation bound go first, oldest first (starvation.lua): each leaves the
-- queue before the heads are read, so it is not met again among them.
local overdue, o = {}, 1
if bound > 0 and n > 0 then overdue = starving(arrivals, KEYS[1], now - bound, n) end
while true do
  if claimed >= n then break end
  if cap > 0 and active >= cap then out[1] = 'full'; break end
  local id
  if o <= #overdue then
    id, o = overdue[o], o + 1
  else
    if h > #heads then
      local want = n - claimed
      if cap > 0 then want = math.min(want, cap - active) end
      -- Read, not popped: a limiter that fails (a script error keeps what was written) must
      -- not lose the task.
      heads, h = redis.call('ZRANGE', KEYS[1], 0, want - 1), 1
      if #heads == 0 then out[1] = 'empty'; break end
    end
    id, h = heads[h], h + 1
  end
  if only and id ~= only then break end  -- another goes first: the dispatchers' (see below)
  local task = prefix .. id
  local tf = redis.call('HMGET', task, 'type', 'pexp', 'cost', 'dl', 'attempts', 'created_at',
    'user_id', 'owner', 'owner_ms', 'waited')
  local ttype = tf[1]
  -- A proxied request's API process holds its caller (app/queue/owners.py): another's claim
  -- admits it for a short lease only, which that process renews once it hears; `gone`: since
  -- when a claim has seen its process's marker lapsed.
  local pickup = ttype == 'proxy' and id ~= only and tonumber(tf[9]) or nil
  local expired = tf[2] and tonumber(tf[2]) <= now
  local gone
  if pickup and not expired and now - (tonumber(tf[6]) or now) > pickup then
    gone = owner_gone(tf[8], now)
  end
  if not ttype then
    redis.call('ZREM', KEYS[1], id)  -- its hash is gone: never runs
  elseif expired then
    -- Past its pending deadline: never runs, even if the sweep (expire-5.lua) is late.
    expire_pending(task, id, KEYS[1], stats, KEYS[10], KEYS[11], now)
    changed[#changed + 1] = id
  elseif gone and now - gone < owner_settle(pickup) then
    -- Its marker lapsed, maybe only for a Redis outage: the line waits for a live process to
    -- write it again.
    out[1], out[2], settling = 'limited', owner_settle(pickup) - (now - gone), true
    break
  elseif gone then
    -- Its API process is gone: nobody would make the call. It never starts, as the reaper
    -- ends one whose process died mid-call.
    redis.call('ZREM', KEYS[1], id)
    if arrivals then redis.call('ZREM', arrivals, id) end
    if tf[4] then redis.call('ZREM', deadlines, id) end
    stats_failure(stats, redis.call('HINCRBY', stats, 'failed', 1), now, id, '',
      'caller connection lost')
    to_outbox(KEYS[10], KEYS[11], task, id, now, 'status', 'failed',
      'result', 'caller connection lost')
    changed[#changed + 1] = id
  else
    local token = token_prefix .. ':' .. claimed
    local wait, binding
    if #limits == 0 then wait = rl_acquire(kind, KEYS[3], KEYS[12], rate, interval, guard, now, token)
    else
      if settles then  -- never less than the caller's recent real cost (see the header)
        local real = rc_read(rc, tf[7] or '')
        local floor = real and math.ceil(real) or whole
        if floor > (tonumber(tf[3]) or 1) then
          tf[3] = floor
          redis.call('HSET', task, 'cost', floor)
        end
      end
      wait, binding = lim_acquire(limits, now, token, tonumber(tf[3]) or 1)
    end
    if wait > 0 then out[1] = 'limited'; out[2] = wait; limited_by = lim_name(binding); break end
    redis.call('ZREM', KEYS[1], id)
    if arrivals then redis.call('ZREM', arrivals, id) end
    -- Started, it has no pending deadline left (expire-5.lua): a per_user endpoint lists
    -- every task there, which must not hold each one for a whole pending TTL. Only tasks
    -- submit-11.lua put there (marked `dl`): no extra command per task for the others.
    if tf[4] then redis.call('ZREM', deadlines, id) end
    local deadline = now + lease
    if ttype == 'online' then deadline = now + permit_ttl
    -- 3 s at least: time to hear of it and renew, however short the marker's TTL.
    elseif pickup then deadline = now + math.min(lease, math.max(pickup, 3000)) end
    active = active + redis.call('ZADD', KEYS[2], deadline, id)
    local attempts = (tonumber(tf[5]) or 0) + 1
    redis.call('HSET', task, 'status', 'processing', 'lease', token, 'started_at', now,
      'deadline', deadline, 'attempts', attempts, 'waited', 1)
    -- it has started: handed back later, it still runs
    if tf[2] then redis.call('HDEL', task, 'pexp') end
    -- A started task lives until it ends, and every ending sets its TTL: a call made near the
    -- pending deadline that outlasts the rest of it must not lose its task mid-call.
    redis.call('PERSIST', task)
    claimed = claimed + 1
    changed[#changed + 1] = id
    if not tf[10] then  -- time in line before its first start: not again after a hand-back,
      -- a refusal given back (attempts count down then) or an operator's retry
      stats_tally(waits, 'queue_wait_ms', now - (tonumber(tf[6]) or now))
    end
    local req = redis.call('HMGET', task, 'method', 'url', 'headers', 'query', 'body')
    local k = #out
    out[k + 1], out[k + 2], out[k + 3], out[k + 4], out[k + 5] = id, token, attempts, ttype, req[1]
    out[k + 6], out[k + 7], out[k + 8], out[k + 9], out[k + 10] = req[2], req[3], req[4], req[5],
      tf[3] or 1
  end
end
stats_flush(stats, waits)

if probing and claimed > 0 then
  redis.call('SET', probe, token_prefix .. ':0', 'PX',
    math.max(lease, permit_ttl))
end
if budget and claimed > 0 then redis.call('HINCRBY', stats, 'ubudget', -claimed) end
if claimed > 0 then
  redis.call('HSET', stats, 'last_admit', now)  -- when the limiter admits next (estimate_wait)
  redis.call('HINCRBY', stats, 'admitted', claimed)
  stats_tick(stats, 'admitted', now, claimed)
end
if only and claimed > 0 and out[1] == 'more' and redis.call('ZCARD', KEYS[1]) == 0 then
  -- Its own task claimed (N = 1 reached) and nothing behind it: no dispatcher needed. Work
  -- left behind ('more') wakes them below, as the submit would have; a refusal ('limited')
  -- schedules them in KEYS[5] for when the limit admits again, and a full cap is woken by the
  -- ack that frees a slot: a wake now would only have their claim refused again.
  out[1] = 'empty'
end
-- The line emptied under further limits: when the next task would be admitted, for the next
-- submit's estimate (estimate_wait reads `limited_until`, as after a refusal). Once a burst.
if out[1] == 'empty' and claimed > 0 and #limits > 0 then
  local cost = tonumber(redis.call('HGET', stats, 'cost_avg')) or 1
  local w, b = lim_acquire(limits, now, token_prefix .. ':peek', cost, true)
  if w > 0 then redis.call('HSET', stats, 'limited_until', now + w, 'limited_by', lim_name(b)) end
end
if out[1] == 'limited' then
  if not settling then
    redis.call('HINCRBY', stats, 'limited', 1)
    -- For operators (stats.py binding) and the head of the line's wait (estimate_wait).
    redis.call('HSET', stats, 'limited_until', now + out[2], 'limited_by', limited_by)
  end
  redis.call('ZADD', KEYS[5], now + out[2], endpoint)
elseif out[1] == 'more' then
  redis.call('ZADD', KEYS[4], 'NX', now, endpoint)
end
local next_retry = redis.call('ZRANGE', retry, 0, 0, 'WITHSCORES')
if #next_retry > 0 then redis.call('ZADD', KEYS[5], 'LT', next_retry[2], endpoint) end
publish_changed(KEYS[1], changed)
return out
