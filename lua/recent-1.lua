--[[ Admissions within a sliding-window limiter's window, for the admin view: counted back from
the Redis clock that stamped them (lua/includes/ratelimit.lua), not from the reader's.
KEYS[1] the limiter's ZSet (score = admission ms)    ARGV[1] the window (ms)
Returns how many admissions are younger than the window.
]]
--@include now.lua

return redis.call('ZCOUNT', KEYS[1], '(' .. int(now_ms() - tonumber(ARGV[1])), '+inf')
