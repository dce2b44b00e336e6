--[[ Cancel a task of this user: a pending one leaves its queue; an admitted online one loses
its permit and frees its slot; an offline or proxied call in flight loses its lease and frees
its slot, and the process holding it aborts the call: the dispatcher hears so on the cancel
channel (events.lua), a proxy relay on the task's status event (its ack, refused for the lost
lease, changes nothing: the first writer wins). Its cost reservation stays spent: the upstream
may have counted the call. Anything that already ended stays.
KEYS[1] task    KEYS[2] queue    KEYS[3] active    KEYS[4] wake    KEYS[5] outbox
KEYS[6] retry    KEYS[7] stats    KEYS[8] hooks (lifecycle.lua)    KEYS[9] probe (upstream.lua):
an online probe cancelled is no probe any more; the next claim sends another
ARGV[1] task id    ARGV[2] user id    ARGV[3] unused (the done TTL: set once SQL has the row)    ARGV[4] endpoint id
ARGV[5] optional: 'expire' for a caller's own max wait run out (a proxied request): a pending
task ends `expired`, as the expiry sweep would end it (lifecycle.lua), and one already admitted
is left to run (a conflict).
Returns {'cancelled'} | {'expired'} | {'missing'} | {'conflict', current status}.
]]
--@include now.lua
--@include lifecycle.lua
--@include stats.lua
--@include events.lua
--@include upstream.lua

local f = redis.call('HMGET', KEYS[1], 'user_id', 'status', 'type', 'lease')
if not f[1] or f[1] ~= ARGV[2] then return {'missing'} end
local now = now_ms()
if ARGV[5] == 'expire' then
  if f[2] ~= 'pending' then return {'conflict', f[2]} end
  redis.call('ZREM', KEYS[6], ARGV[1])  -- waiting out a pause the upstream asked for
  expire_pending(KEYS[1], ARGV[1], KEYS[2], KEYS[7], KEYS[5], KEYS[8], now)
  publish_changed(KEYS[2], {ARGV[1]})
  return {'expired'}
end
if f[2] == 'pending' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[6], ARGV[1])  -- waiting out a retry back-off
elseif f[2] == 'processing' then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[1], 'lease', 'deadline')
  if f[4] then upstream_call_ended(KEYS[7], KEYS[9], f[4], false) end
  if redis.call('ZCARD', KEYS[2]) > 0 then
    redis.call('ZADD', KEYS[4], 'NX', now, ARGV[4])
  end
  if f[3] ~= 'online' then publish_cancel(KEYS[3], ARGV[1]) end
else
  return {'conflict', f[2]}
end
to_outbox(KEYS[5], KEYS[8], KEYS[1], ARGV[1], now, 'status', 'cancelled')
publish_changed(KEYS[2], {ARGV[1]})
redis.call('HINCRBY', KEYS[7], 'cancelled', 1)
return {'cancelled'}
