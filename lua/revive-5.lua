--[[ Run again a dead letter Redis has let go (an operator's retry, from its SQL row): its hash
made anew from the row's request, pending, back in its queue at its original place.
KEYS[1] task    KEYS[2] queue    KEYS[3] wake
KEYS[4] endpoints (the registry hash): no task goes into the queue of a deleted endpoint
KEYS[5] deadlines (as requeue-7.lua: `dl` 2)
KEYS[6..] arrivals (only for an endpoint with max_starvation_s): the task goes into it at its
first arrival (the pairs' `arrived_at`, the row's creation; starvation.lua)
ARGV[1] task id    ARGV[2] endpoint id    ARGV[3] pending TTL (ms)    ARGV[4] done TTL (ms)
ARGV[5] its score (place in line)    ARGV[6..] field, value pairs (owner, type, request,
`ended_before`: the row's ending, which the next one comes after, now.lua ending_ms; its
`created_at`, which replaces the revival's time written before it, and `waited` once it started)
Returns {'retried', rank} | {'exists', status} (Redis has it again: requeue-7.lua's to judge) |
{'gone'}.
]]
--@include now.lua
--@include events.lua
--@include starvation.lua

if redis.call('HEXISTS', KEYS[4], ARGV[2]) == 0 then return {'gone'} end
local status = redis.call('HGET', KEYS[1], 'status')
if status then return {'exists', status} end
local now = now_ms()
local pending_ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'pending', 'created_at', now, 'score', ARGV[5],
  'attempts', 0, 'pexp', now + pending_ttl, 'dl', 2, unpack(ARGV, 6))
redis.call('ZADD', KEYS[5], now + pending_ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], pending_ttl + tonumber(ARGV[4]))
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
starve_back(unpack(KEYS, 6), KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[3], 'NX', now, ARGV[2])
publish_changed(KEYS[2], {ARGV[1]})
return {'retried', redis.call('ZRANK', KEYS[2], ARGV[1])}
