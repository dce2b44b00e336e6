--[[ Put a claimed task whose call failed and may be retried aside until its back-off is over,
if the caller still holds its lease. Its slot frees at once, and nothing of the wait lives in
the dispatcher's memory: the claim (claim-12.lua) puts it back in line, with its original score,
once it is due, and the reaper's promote wakes the endpoint then if its dispatcher died.
KEYS[1] active    KEYS[2] task    KEYS[3] retry (ZSet id -> due, ms)    KEYS[4] delayed
KEYS[5] queue     KEYS[6] wake    KEYS[7] stats    KEYS[8] probe (upstream.lua)
KEYS[9..] the further limits' state and pace keys, two per limit of ARGV[10..] (only with
ARGV[9]), then arrivals (only for an endpoint with max_starvation_s): a refusal given back goes
back into it at its first arrival (starvation.lua; a retry due later, when the claim puts it
back in line)
ARGV[1] task id   ARGV[2] lease token   ARGV[3] back-off (ms)   ARGV[4] endpoint id
ARGV[5] pause the upstream asked for (ms; 0 = none), see upstream.lua
ARGV[6] the failed call's HTTP status ('' if none)   ARGV[7] its exec time (ms; -1 = no call
made, or none that tells of the upstream: not counted as one)
ARGV[8] how many refusals a task may have for free (0 = this call was not refused with a pause):
a call the upstream refused asking for a pause (429/503 with a reset or Retry-After) did no work,
so up to that many times the task goes straight back to its place in line (original score),
its attempt given back and no back-off of its own: the endpoint's pause holds it
ARGV[9] the call's real cost ('' or absent = unknown; 0 when the upstream refused it), ARGV[10..]
the endpoint's further limits as claim-12.lua takes them: the per-cost ones settle this
attempt's reservation (limits.lua), as ack-7.lua does; the retry is a new admission, which
reserves again
Returns the due time (ms, Redis clock), 1 when the task went back in line at once (a refusal
given back), or 0 when the lease was lost.  The retry is counted in the endpoint's stats
(KEYS[7], stats.lua), with the failed call.
]]
--@include now.lua
--@include stats.lua
--@include upstream.lua
--@include events.lua
--@include ratelimit.lua
--@include limits.lua
--@include adaptive.lua
--@include starvation.lua

local lease, started = unpack(redis.call('HMGET', KEYS[2], 'lease', 'started_at'))
if lease ~= ARGV[2] then return 0 end
local now = now_ms()
lim_settle_task(KEYS[2], ARGV[2], tonumber(ARGV[9] or ''), ARGV, 10, KEYS, 9, now)
local due = now + tonumber(ARGV[3])
local pause = tonumber(ARGV[5]) or 0
if pause > 0 then
  upstream_pause(KEYS[7], KEYS[8], now, pause)
else
  upstream_call_ended(KEYS[7], KEYS[8], ARGV[2], false)
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], 'lease', 'deadline')
local stats = KEYS[7]
redis.call('HINCRBY', stats, 'retried', 1)
if tonumber(ARGV[7]) >= 0 then stats_call_failed(stats, ARGV[6], tonumber(ARGV[7])) end
local samples = {}
adaptive_note(samples, 'failed', ARGV[6], tonumber(ARGV[7]), tonumber(started))
adaptive_update(stats, now, samples, KEYS[1])
local free = tonumber(ARGV[8]) or 0
if free > 0 and redis.call('HINCRBY', KEYS[2], 'refusals', 1) <= free then
  redis.call('HINCRBY', KEYS[2], 'attempts', -1)
  redis.call('HSET', KEYS[2], 'status', 'pending')
  redis.call('ZADD', KEYS[5], redis.call('HGET', KEYS[2], 'score'), ARGV[1])
  starve_back(KEYS[9 + 2 * (tonumber(ARGV[9] or '') and tonumber(ARGV[10]) or 0)], KEYS[2],
    ARGV[1])
  redis.call('ZADD', KEYS[6], 'NX', now, ARGV[4])  -- its claim meets the pause, and waits
  publish_changed(KEYS[1], {ARGV[1]})
  return 1
end
redis.call('HSET', KEYS[2], 'status', 'pending', 'retry_at', due)
redis.call('ZADD', KEYS[3], due, ARGV[1])
redis.call('ZADD', KEYS[4], 'LT', due, ARGV[4])  -- the earliest due retry wakes the endpoint
if redis.call('ZCARD', KEYS[5]) > 0 then
  redis.call('ZADD', KEYS[6], 'NX', now, ARGV[4])  -- its slot is free: worth a claim
end
publish_changed(KEYS[1], {ARGV[1]})  -- processing -> pending (app/queue/events.py)
return due
