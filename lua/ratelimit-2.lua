--[[ One limiter check on its own: the same code claim-5.lua runs before it pops a task.  The
dispatcher runs it again right before each call, on the endpoint's `sent` keys, with pacing
(see ratelimit.lua).
KEYS[1] limiter state    KEYS[2] pacing state (used when ARGV[6] == '1')
ARGV[1] limiter kind ('sliding_window' | 'fixed_window' | 'token_bucket')
ARGV[2] rate (0 = none)    ARGV[3] interval (ms)    ARGV[4] member, unique per admission
ARGV[5] guard (ms)    ARGV[6] '1' to pace as well
Returns {wait ms, now}: wait 0 means admitted and recorded; otherwise nothing was recorded and
an admission could succeed `wait` ms after `now` (ms, Redis clock).
]]
--@include now.lua
--@include ratelimit.lua

local now = now_ms()
local kind, rate, interval, guard = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
if rate <= 0 then return {0, now} end
local paced
if ARGV[6] == '1' then
  local wait
  wait, paced = rl_pace(KEYS[2], rate, interval, guard, now)
  if wait > 0 then return {wait, now} end
end
local wait = rl_acquire(kind, KEYS[1], rate, interval, guard, now, ARGV[4])
if wait == 0 and paced then
  redis.call('SET', KEYS[2], string.format('%.3f', paced), 'PX', math.max(1, math.ceil(paced - now)))
end
return {wait, now}
