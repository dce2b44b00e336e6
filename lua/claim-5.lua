--[[ Claim up to N tasks of one endpoint: limiter, concurrency cap, pop and lease in one step.
KEYS[1] queue    KEYS[2] active    KEYS[3] limiter state    KEYS[4] wake
KEYS[5] delayed  ZSet of limited endpoints; score = when the limiter admits again
ARGV[1] endpoint id         ARGV[2] N (free capacity of the caller)
ARGV[3] max concurrency (0 = none)    ARGV[4] lease (ms)
ARGV[5] limiter kind        ARGV[6] rate (0 = none)    ARGV[7] interval (ms)
ARGV[8] task key prefix (same hash tag as KEYS, so the script stays in one slot)
ARGV[9] lease token prefix (unique per call)    ARGV[10] permit TTL (ms) for online tasks
ARGV[11] limiter guard (ms), see ratelimit.lua
ARGV[12] how many further limits (API.md `limits`; 0 or absent = none), then kind, rate,
interval (ms), guard (ms), per ('request' | 'cost') each: checked with the main one, all or
none admitting (limits.lua); their state keys are siblings of KEYS[1]. A per-cost limit spends
the task's `cost` field.
An endpoint its upstream paused (upstream.lua) is 'limited' until then, then claims one probe.
Returns {state, wait ms, now, then per claim: id, token, attempts, type, method, url, headers,
query, body, cost (what it spent of per-cost limits, uncapped)}; state is
'more' (N reached, work remains), 'empty', 'full' (concurrency cap) or 'limited' (retry in wait ms).
Task ids whose hash has expired are dropped from the queue on the way; tasks past their
pending deadline are expired (lifecycle.lua; the stats and outbox keys are siblings of KEYS[1]).
Tasks whose retry back-off is over (retry-6.lua; the retry set is a sibling of KEYS[1]) go back
in line first, with their original score; the earliest one not yet due stays scheduled in
KEYS[5].
]]
--@include now.lua
--@include ratelimit.lua
--@include lifecycle.lua
--@include stats.lua
--@include upstream.lua
--@include events.lua
--@include limits.lua

redis.call('ZREM', KEYS[5], ARGV[1])  -- this attempt consumes any scheduled retry

local endpoint, n, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local lease, kind, rate, interval = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local prefix, token_prefix, permit_ttl = ARGV[8], ARGV[9], tonumber(ARGV[10])
local guard = tonumber(ARGV[11])
-- With further limits, the main one is checked among them (undone if another refuses).
local limits = lim_parse(KEYS[1], ARGV, 12)
if #limits > 0 and rate > 0 then
  table.insert(limits, 1, {kind = kind, key = KEYS[3], rate = rate, interval = interval,
    guard = guard, per = 'request', main = true})
end
local now = now_ms()
local retry = sibling_key(KEYS[1], 'retry')
for _, id in ipairs(redis.call('ZRANGEBYSCORE', retry, '-inf', now, 'LIMIT', 0, 1000)) do
  local score = redis.call('HGET', prefix .. id, 'score')
  if score then
    redis.call('ZADD', KEYS[1], score, id)
    redis.call('HDEL', prefix .. id, 'retry_at')
  end
  redis.call('ZREM', retry, id)
end
local out = {'more', 0, now}
local stats = sibling_key(KEYS[1], 'stats')  -- the dispatcher fixes KEYS
local deadlines = sibling_key(KEYS[1], 'deadlines')
local claimed = 0
local changed = {}  -- ids whose status this run changes, published once at the end

-- Paused by its upstream (upstream.lua): nothing until then, then one probe at a time.
local paused, probing = tonumber(redis.call('HGET', stats, 'upause')), false
if paused and paused > now then
  out[1], out[2], n = 'limited', paused - now, 0
elseif paused and redis.call('EXISTS', sibling_key(KEYS[1], 'probe')) == 1 then
  out[1], n = 'full', 0  -- the probe's ending wakes it
elseif paused then
  probing, n = true, 1
end

while true do
  if claimed >= n then break end
  if cap > 0 and redis.call('ZCARD', KEYS[2]) >= cap then out[1] = 'full'; break end
  local head = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #head == 0 then out[1] = 'empty'; break end
  local id = head[1]
  local task = prefix .. id
  local tf = redis.call('HMGET', task, 'type', 'pexp', 'cost', 'dl')
  local ttype = tf[1]
  if not ttype then
    redis.call('ZREM', KEYS[1], id)  -- its hash is gone: never runs
  elseif tf[2] and tonumber(tf[2]) <= now then
    -- Past its pending deadline: never runs, even if the sweep (expire-3.lua) is late.
    expire_pending(task, id, KEYS[1], stats, sibling_key(KEYS[1], 'tosql'), now)
    changed[#changed + 1] = id
  else
    local token = token_prefix .. ':' .. claimed
    local wait
    if #limits == 0 then wait = rl_acquire(kind, KEYS[3], rate, interval, guard, now, token)
    else wait = lim_acquire(limits, now, token, tonumber(tf[3]) or 1) end
    if wait > 0 then out[1] = 'limited'; out[2] = wait; break end
    redis.call('ZREM', KEYS[1], id)
    -- Started, it has no pending deadline left (expire-3.lua): a per_user endpoint lists
    -- every task there, which must not hold each one for a whole pending TTL. Only tasks
    -- submit-7.lua put there (marked `dl`): no extra command per task for the others.
    if tf[4] then redis.call('ZREM', deadlines, id) end
    local deadline = now + lease
    if ttype == 'online' then deadline = now + permit_ttl end
    redis.call('ZADD', KEYS[2], deadline, id)
    local attempts = redis.call('HINCRBY', task, 'attempts', 1)
    redis.call('HSET', task, 'status', 'processing', 'lease', token, 'started_at', now,
      'deadline', deadline)
    redis.call('HDEL', task, 'pexp')  -- it has started: handed back later, it still runs
    -- A started task lives until it ends, and every ending sets its TTL: a call made near the
    -- pending deadline that outlasts the rest of it must not lose its task mid-call.
    redis.call('PERSIST', task)
    claimed = claimed + 1
    changed[#changed + 1] = id
    if attempts == 1 then  -- time in line before its first start (not after a hand-back)
      local created = tonumber(redis.call('HGET', task, 'created_at')) or now
      stats_observe(stats, 'queue_wait_ms', now - created)
    end
    local req = redis.call('HMGET', task, 'method', 'url', 'headers', 'query', 'body')
    local fields = {id, token, attempts, ttype, req[1], req[2], req[3], req[4], req[5], tf[3] or 1}
    for _, v in ipairs(fields) do
      out[#out + 1] = v
    end
  end
end

if probing and claimed > 0 then
  redis.call('SET', sibling_key(KEYS[1], 'probe'), token_prefix .. ':0', 'PX',
    math.max(lease, permit_ttl))
end
if claimed > 0 then
  redis.call('HSET', stats, 'last_admit', now)  -- when the limiter admits next (estimate_wait)
  redis.call('HINCRBY', stats, 'admitted', claimed)
  stats_tick(stats, 'admitted', now, claimed)
end
if out[1] == 'limited' then
  redis.call('HINCRBY', stats, 'limited', 1)
  redis.call('HSET', stats, 'limited_until', now + out[2])  -- for operators (stats.py binding)
  redis.call('ZADD', KEYS[5], now + out[2], endpoint)
elseif out[1] == 'more' then
  redis.call('ZADD', KEYS[4], 'NX', now, endpoint)
end
local next_retry = redis.call('ZRANGE', retry, 0, 0, 'WITHSCORES')
if #next_retry > 0 then redis.call('ZADD', KEYS[5], 'LT', next_retry[2], endpoint) end
publish_changed(KEYS[1], changed)
return out
