--[[ Wake endpoints whose limiter wait is over but whose retry nobody ran (its dispatcher died).
The dispatcher that saw the limit normally retries on time itself; this is the fallback.
KEYS[1] delayed    KEYS[2] wake
ARGV[1] grace (ms) past the due time
Returns the number of endpoints woken.
]]
--@include now.lua

local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]))
for _, endpoint in ipairs(due) do
  redis.call('ZREM', KEYS[1], endpoint)
  redis.call('ZADD', KEYS[2], 'NX', now, endpoint)
end
return #due
