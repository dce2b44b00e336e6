--[[ An online task's caller is done with the business API: free its slot before the permit
expires, and keep the result it reports.
KEYS[1] task    KEYS[2] active    KEYS[3] queue    KEYS[4] wake    KEYS[5] outbox
ARGV[1] task id    ARGV[2] user id    ARGV[3] result    ARGV[4] unused (the done TTL: set once SQL has the row)    ARGV[5] endpoint
Returns {'completed'} | {'missing'} | {'conflict', current status}.
]]
--@include now.lua
--@include lifecycle.lua
--@include stats.lua
--@include events.lua

local f = redis.call('HMGET', KEYS[1], 'user_id', 'status', 'type', 'started_at')
if not f[1] or f[1] ~= ARGV[2] then return {'missing'} end
if f[2] ~= 'processing' or f[3] ~= 'online' then return {'conflict', f[2]} end
local now = now_ms()
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], 'lease', 'deadline')
redis.call('HSET', KEYS[1], 'status', 'completed', 'result', ARGV[3], 'ended_at', now)
to_outbox(KEYS[5], KEYS[1], ARGV[1], now)
publish_changed(KEYS[2], {ARGV[1]})
local stats = sibling_key(KEYS[2], 'stats')
redis.call('HINCRBY', stats, 'completed', 1)
-- An online slot is held until its caller is done: that time is what the wait estimate needs.
if tonumber(f[4]) then stats_ema(stats, 'slot_ms', now - tonumber(f[4])) end
stats_tick(stats, 'done', now, 1)
if redis.call('ZCARD', KEYS[3]) > 0 then
  redis.call('ZADD', KEYS[4], 'NX', now, ARGV[5])
end
return {'completed'}
