--[[ Hand a claimed task back to its queue at once (its dispatcher is shutting down), if the
caller still holds its lease: no wait for the lease to run out.  The task keeps its original
score, so it goes back to its place in line, and its attempt count: an interrupted call counts,
so the task fails instead when that call was its last allowed one (as the reaper does).
KEYS[1] active    KEYS[2] task    KEYS[3] queue    KEYS[4] wake    KEYS[5] stats
KEYS[6] outbox    KEYS[7] hooks (lifecycle.lua)    KEYS[8] probe (upstream.lua): a probe handed
back is no probe any more; the next claim sends another
KEYS[9..] arrivals (only for an endpoint with max_starvation_s): the task goes back into it at
its first arrival (starvation.lua)
ARGV[1] task id   ARGV[2] lease token   ARGV[3] endpoint id   ARGV[4] max attempts
ARGV[5] unused (the done TTL: set once SQL has the row)
Returns 1 (re-queued), 2 (failed: no attempt left) or 0 (lease lost: somebody else has it).
A failed task goes to the endpoint's outbox (see lifecycle.lua).
]]
--@include now.lua
--@include lifecycle.lua
--@include stats.lua
--@include events.lua
--@include upstream.lua
--@include starvation.lua

if redis.call('HGET', KEYS[2], 'lease') ~= ARGV[2] then return 0 end
local now = now_ms()
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], 'lease', 'deadline')
upstream_call_ended(KEYS[5], KEYS[8], ARGV[2], false)
local f = redis.call('HMGET', KEYS[2], 'attempts', 'score')
if tonumber(f[1]) >= tonumber(ARGV[4]) then
  local n = redis.call('HINCRBY', KEYS[5], 'failed', 1)
  stats_failure(KEYS[5], n, now, ARGV[1], '', 'interrupted on attempt ' .. f[1])
  to_outbox(KEYS[6], KEYS[7], KEYS[2], ARGV[1], now, 'status', 'failed',
    'result', 'interrupted on attempt ' .. f[1] .. ': the dispatcher shut down')
  publish_changed(KEYS[1], {ARGV[1]})
  -- Its slot (and maybe the probe) is free for the tasks behind it.
  if redis.call('ZCARD', KEYS[3]) > 0 then redis.call('ZADD', KEYS[4], 'NX', now, ARGV[3]) end
  return 2
end
redis.call('HSET', KEYS[2], 'status', 'pending')
redis.call('ZADD', KEYS[3], f[2], ARGV[1])
starve_back(unpack(KEYS, 9), KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[5], 'released', 1)
redis.call('ZADD', KEYS[4], 'NX', now, ARGV[3])
publish_changed(KEYS[1], {ARGV[1]})
return 1
