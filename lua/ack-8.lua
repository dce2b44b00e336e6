--[[ Finish a claimed task, if the caller still holds its lease.
KEYS[1] active    KEYS[2] task    KEYS[3] queue    KEYS[4] wake    KEYS[5] stats
KEYS[6] outbox    KEYS[7] hooks (lifecycle.lua)    KEYS[8] probe (upstream.lua)
KEYS[9..] the further limits' state and pace keys, two per limit of ARGV[12..] (only with ARGV[10])
ARGV[1] task id   ARGV[2] lease token   ARGV[3] final status ('completed' | 'failed')
ARGV[4] result    ARGV[5] result status code ('' if none)
ARGV[6] 'claims' when the caller runs claim-12.lua for this endpoint right after, in the same
pipeline (it then leaves the wake marker to that claim); anything else: the marker is added here
ARGV[7] endpoint id    ARGV[8] exec time of the last attempt (ms; -1 = no call made)
ARGV[9] pause the upstream asked for (ms; 0 = none), see upstream.lua
ARGV[10] the call's real cost ('' or absent = unknown), ARGV[11..] the endpoint's further
limits as claim-12.lua takes them (ARGV[12..]): the per-cost ones settle the task's reservation
(its `cost` field) to the real cost (limits.lua)
Returns 1, 2 when tasks still wait in the queue, or 0 when the lease was lost (reaped and
claimed again): the newer attempt wins.
The finished task goes to the endpoint's outbox (see lifecycle.lua).
]]
--@include now.lua
--@include stats.lua
--@include lifecycle.lua
--@include upstream.lua
--@include events.lua
--@include ratelimit.lua
--@include limits.lua

if redis.call('HGET', KEYS[2], 'lease') ~= ARGV[2] then return 0 end
local now = now_ms()
lim_settle_task(KEYS[2], ARGV[2], tonumber(ARGV[10] or ''), ARGV, 11, KEYS, 9, now)
local pause = tonumber(ARGV[9]) or 0
if pause > 0 then
  upstream_pause(KEYS[5], KEYS[8], now, pause)
else
  upstream_call_ended(KEYS[5], KEYS[8], ARGV[2], ARGV[3] == 'completed')
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'status', ARGV[3], 'result', ARGV[4],
  'result_status_code', ARGV[5], 'ended_at', now)
redis.call('HDEL', KEYS[2], 'lease', 'deadline')
to_outbox(KEYS[6], KEYS[7], KEYS[2], ARGV[1], now)
publish_changed(KEYS[1], {ARGV[1]})

local n = redis.call('HINCRBY', KEYS[5], ARGV[3], 1)
local exec = tonumber(ARGV[8])
if ARGV[3] == 'completed' and exec >= 0 then
  stats_ema(KEYS[5], 'exec_ms', exec)  -- recent completions, for the dashboard
  stats_observe(KEYS[5], 'upstream_ms', exec)
elseif ARGV[3] == 'failed' then
  stats_failure(KEYS[5], n, now, ARGV[1], ARGV[5], ARGV[4])
  if exec >= 0 then stats_call_failed(KEYS[5], ARGV[5], exec) end
end
-- The wait estimate needs how long a task holds its slot, from its claim to here (a retry's
-- back-off is not in it: retry-8.lua gives the slot back, and the claim sets started_at anew).
local started = tonumber(redis.call('HGET', KEYS[2], 'started_at'))
if started then stats_ema(KEYS[5], 'slot_ms', now - started) end
stats_tick(KEYS[5], 'done', now, 1)
if redis.call('ZCARD', KEYS[3]) == 0 then return 1 end
if ARGV[6] ~= 'claims' then
  redis.call('ZADD', KEYS[4], 'NX', now, ARGV[7])  -- a slot is free: worth a claim
end
return 2
