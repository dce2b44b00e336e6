--[[ Wake an endpoint that has claimable work but no wake marker.
A marker is consumed by BZPOPMIN before the claim runs, so a dispatcher killed in between, a
reply lost to a dropped connection, or a dispatcher with no room for the endpoint can leave
pending tasks that nobody is told about.  The reaper runs this for every endpoint.
KEYS[1] queue    KEYS[2] active    KEYS[3] wake    KEYS[4] delayed
ARGV[1] endpoint id    ARGV[2] max concurrency (0 = none)
Returns 1 when it woke the endpoint, else 0.
]]
--@include now.lua

if redis.call('ZCARD', KEYS[1]) == 0 then return 0 end
local cap = tonumber(ARGV[2])
if cap > 0 and redis.call('ZCARD', KEYS[2]) >= cap then return 0 end  -- its acks wake it
if redis.call('ZSCORE', KEYS[4], ARGV[1]) then return 0 end  -- limited: promote wakes it
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[3], now_ms(), ARGV[1])
return 1
