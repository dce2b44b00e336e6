--[[ Run a failed or expired task again (an operator's retry, of any user's task): back into its
queue at its original place, pending with a fresh deadline and no attempts counted.
KEYS[1] task    KEYS[2] queue    KEYS[3] wake    KEYS[4] outbox    KEYS[5] delivered
KEYS[6] endpoints (the registry hash): no task goes back into the queue of a deleted endpoint,
        which nobody would claim, reap or expire
KEYS[7] deadlines: its new deadline may come after those of the tasks behind it in its band,
        so the expiry sweep finds it there (`dl` 2) and walks past it (expire-5.lua)
KEYS[8..] arrivals (only for an endpoint with max_starvation_s): the task goes back into it at
its first arrival (starvation.lua)
ARGV[1] task id    ARGV[2] endpoint id    ARGV[3] pending TTL (ms)    ARGV[4] done TTL (ms)
Its copy still waiting in the outbox (the old ending) is dropped, and it is taken off the
delivered set, so the next ending reaches SQL and its owner like a first one. The old ending's
time stays as `ended_before`: the next one is later (now.lua ending_ms).
A proxied request (type `proxy`) never runs again: its answer had one reader, the caller's
connection, which is gone.
Returns {'retried', rank, old ended_at ('' if none)} | {'missing'} | {'conflict', status} |
{'gone'} | {'proxy', current status}. The caller deletes the old ending's SQL row by that time
(only that ending's: the delete may land late, after the task ended again).
]]
--@include now.lua
--@include stats.lua
--@include events.lua
--@include starvation.lua

if redis.call('HEXISTS', KEYS[6], ARGV[2]) == 0 then return {'gone'} end
local f = redis.call('HMGET', KEYS[1], 'status', 'score', 'type', 'ended_at')
if not f[1] then return {'missing'} end
if f[3] == 'proxy' then return {'proxy', f[1]} end
if f[1] ~= 'failed' and f[1] ~= 'expired' then return {'conflict', f[1]} end
local now = now_ms()
local pending_ttl = tonumber(ARGV[3])
redis.call('HDEL', KEYS[1], 'result', 'result_status_code', 'result_meta', 'started_at', 'ended_at',
  'lease', 'deadline', 'permit_uses', 'refusals')  -- a new permit, free refusals afresh
-- Its next ending comes after this one whatever the clock then says (now.lua ending_ms).
if f[4] then redis.call('HSET', KEYS[1], 'ended_before', f[4]) end
redis.call('HSET', KEYS[1], 'status', 'pending', 'attempts', 0, 'pexp', now + pending_ttl, 'dl', 2)
redis.call('ZADD', KEYS[7], now + pending_ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], pending_ttl + tonumber(ARGV[4]))
redis.call('ZADD', KEYS[2], f[2], ARGV[1])
starve_back(unpack(KEYS, 8), KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[3], 'NX', now, ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[1])  -- its old ending no longer goes to SQL
redis.call('ZREM', KEYS[5], ARGV[1])
publish_changed(KEYS[2], {ARGV[1]})
return {'retried', redis.call('ZRANK', KEYS[2], ARGV[1]), f[4] or ''}
