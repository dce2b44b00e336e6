--[[ Enqueue a task, or return the task an Idempotency-Key already names.
KEYS[1] queue      ZSet of pending ids of the endpoint
KEYS[2] task       Hash of the new task
KEYS[3] seq        arrival counter of the endpoint
KEYS[4] wake       ZSet of endpoints worth a claim attempt
KEYS[5] idem       idempotency key (unused unless ARGV[6] == '1')
KEYS[6] quota      the caller's counter for today (seed 000: INCR, expiring at the day's end;
                   the day is the Redis clock's, so an API host's skewed clock cannot move it)
KEYS[7] endpoints  Hash of the endpoint registry (app/core/registry.py): a process whose own
                   copy is stale (paused, overloaded) must not fill the queue of an endpoint
                   that is gone, which nobody would claim, reap or expire
KEYS[8] deadlines  ZSet of tasks whose deadline may come before that of tasks ahead (expire-5.lua)
KEYS[9] stats      KEYS[10] active
KEYS[11] turns     the fairness turns of the task's priority band (Keys.turns; per_user only)
KEYS[12..] arrivals  (only for an endpoint with max_starvation_s) ZSet id -> arrival (ms), for the
                   claim's starvation bound (lua/includes/starvation.lua)
ARGV[1] task id    ARGV[2] endpoint id    ARGV[3] priority    ARGV[4] max queue length
ARGV[5] pending TTL (ms)    ARGV[6] '1' to honour KEYS[5]    ARGV[7] idempotency TTL (ms)
ARGV[8] daily quota (0 = none)    ARGV[9] done TTL (ms)
ARGV[10] '1' when the pending TTL is the caller's deadline (max_wait_s), which may come before
         that of tasks ahead: the deadline set (KEYS[8]) holds it for the sweep
ARGV[11] '' (fairness fifo) or the submitting user's id (fairness per_user: the score is by
         turns, lua/includes/fairness.lua, and the deadline set holds every task), or
         "<user id>/<weight>" (fairness weighted: turns of 1/weight)
ARGV[12] the task's cost, for the average the wait estimate counts tasks ahead at ('' = the
         endpoint has no per-cost limit: nothing kept)
ARGV[13] '1' when the submitting process claims the task itself should it be first in line
         (a proxied request, app/proxy/relay.py): no wake marker then, which would send a
         dispatcher's claim after the same task; what that claim (claim-12.lua `only`)
         leaves is the dispatchers' as after any claim
ARGV[14..] field, value pairs
The task is pending until `pexp` (now + pending TTL; then lua/expire-5.lua or the claim expires
it), and its hash lives a done TTL longer, so its status can still say `expired`.
Returns {'ok', task id, rank, created_at} | {'dup', first task id} | {'full'} |
{'quota', ms until the quota resets} | {'gone'} (the endpoint is deleted)
measured = {exec ms, slot ms, in flight, last admission, upstream pause until, now, limited
until, average cost, adaptive limit} (app/queue/tasks.py MEASURED_FIELDS)
]]
--@include now.lua
--@include fairness.lua
--@include stats.lua

if redis.call('HEXISTS', KEYS[7], ARGV[2]) == 0 then return {'gone'} end
if ARGV[6] == '1' then
  local first = redis.call('GET', KEYS[5])
  if first then return {'dup', first} end
end
local now = now_ms()
local quota = tonumber(ARGV[8])
if quota > 0 and tonumber(redis.call('GET', KEYS[6]) or '0') >= quota then
  return {'quota', redis.call('PTTL', KEYS[6])}
end
local max_len = tonumber(ARGV[4])
if max_len > 0 and redis.call('ZCARD', KEYS[1]) >= max_len then
  return {'full'}
end

-- Strict priority, then arrival: one priority step (2^43) outweighs any arrival count,
-- and the score stays below 2^53 for priorities up to 1000.
local pending_ttl = tonumber(ARGV[5])
local seq = redis.call('INCR', KEYS[3])
local band = -tonumber(ARGV[3]) * 8796093022208
local score
if ARGV[11] == '' then
  score = int(band + seq)
else
  score = int(band + fair_offset(KEYS[1], KEYS[11], band, ARGV[11], seq, pending_ttl))
end

redis.call('HSET', KEYS[2], 'status', 'pending', 'created_at', now, 'score', score,
  'attempts', 0, 'pexp', now + pending_ttl, unpack(ARGV, 14))
redis.call('PEXPIRE', KEYS[2], pending_ttl + tonumber(ARGV[9]))
redis.call('ZADD', KEYS[1], score, ARGV[1])
local arrivals = unpack(KEYS, 12)  -- the optional tail: a starvation-bound endpoint's index
if arrivals then  -- arrival order across priorities; nothing waits longer than a pending TTL
  redis.call('ZADD', arrivals, now, ARGV[1])
  if redis.call('PTTL', arrivals) < pending_ttl then redis.call('PEXPIRE', arrivals, pending_ttl) end
end
-- The caller's own deadline (max_wait_s), or turns (a band of a per_user endpoint is not in
-- deadline order): tasks ahead may not be due before it, so expire-5.lua finds it there.
if ARGV[10] == '1' or ARGV[11] ~= '' then
  redis.call('ZADD', KEYS[8], now + pending_ttl, ARGV[1])
  redis.call('HSET', KEYS[2], 'dl', 1)  -- the claim takes it off the set only when marked
end
local rank = redis.call('ZRANK', KEYS[1], ARGV[1])
if ARGV[13] ~= '1' or rank > 0 then redis.call('ZADD', KEYS[4], 'NX', now, ARGV[2]) end
redis.call('HINCRBY', KEYS[9], 'submitted', 1)
if ARGV[12] ~= '' then stats_ema(KEYS[9], 'cost_avg', tonumber(ARGV[12])) end
if ARGV[6] == '1' then
  redis.call('SET', KEYS[5], ARGV[1], 'PX', ARGV[7])
end
if quota > 0 and redis.call('INCR', KEYS[6]) == 1 then
  redis.call('PEXPIREAT', KEYS[6], int((math.floor(now / 86400000) + 1) * 86400000))
end
-- What the wait estimate needs (app/queue/tasks.py estimate_wait), in the same round trip.
local m = redis.call('HMGET', KEYS[9], 'exec_ms', 'slot_ms', 'last_admit', 'upause',
  'limited_until', 'cost_avg', 'alimit')
local measured = {m[1], m[2], redis.call('ZCARD', KEYS[10]), m[3], m[4], now, m[5], m[6], m[7]}
return {'ok', ARGV[1], rank, now, measured}
