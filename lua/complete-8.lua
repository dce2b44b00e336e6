--[[ An online task's caller is done with the business API: free its slot before the permit
expires, and keep the result it reports.
KEYS[1] task    KEYS[2] active    KEYS[3] queue    KEYS[4] wake    KEYS[5] outbox
KEYS[6] stats    KEYS[7] hooks (lifecycle.lua)    KEYS[8] probe (upstream.lua): an online task
sent as a paused endpoint's probe ends it as a success here, as the ack does for an offline call
ARGV[1] task id    ARGV[2] user id    ARGV[3] result    ARGV[4] unused (the done TTL: set once SQL has the row)    ARGV[5] endpoint
Returns {'completed'} | {'missing'} | {'conflict', current status}.
]]
--@include now.lua
--@include lifecycle.lua
--@include stats.lua
--@include events.lua
--@include upstream.lua

local f = redis.call('HMGET', KEYS[1], 'user_id', 'status', 'type', 'started_at',
  'lease')
if not f[1] or f[1] ~= ARGV[2] then return {'missing'} end
if f[2] ~= 'processing' or f[3] ~= 'online' then return {'conflict', f[2]} end
local now = now_ms()
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], 'lease', 'deadline')
to_outbox(KEYS[5], KEYS[7], KEYS[1], ARGV[1], now, 'status', 'completed', 'result', ARGV[3])
publish_changed(KEYS[2], {ARGV[1]})
local stats = KEYS[6]
-- Its caller is done: the upstream took the call, so the pause is over (no pause is read from an
-- online call; the next one the gateway makes sets it again if need be).
if f[5] then upstream_call_ended(stats, KEYS[8], f[5], true) end
redis.call('HINCRBY', stats, 'completed', 1)
-- An online slot is held until its caller is done: that time is what the wait estimate needs.
if tonumber(f[4]) then stats_ema(stats, 'slot_ms', now - tonumber(f[4])) end
stats_tick(stats, 'done', now, 1)
if redis.call('ZCARD', KEYS[3]) > 0 then
  redis.call('ZADD', KEYS[4], 'NX', now, ARGV[5])
end
return {'completed'}
