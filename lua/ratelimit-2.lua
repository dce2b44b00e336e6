--[[ One limiter check on its own: the same code claim-12.lua runs before it pops a task.
KEYS[1] limiter state    KEYS[2] its pacing state (`<KEYS[1]>:pace:<rate>/<interval>`, Keys.pace)
ARGV[1] limiter kind ('sliding_window' | 'fixed_window' | 'token_bucket')
ARGV[2] rate (0 = none)    ARGV[3] interval (ms)    ARGV[4] member, unique per admission
ARGV[5] guard (ms)
Returns {wait ms, now}: wait 0 means admitted and recorded; otherwise nothing was recorded and
an admission could succeed `wait` ms after `now` (ms, Redis clock).
]]
--@include now.lua
--@include ratelimit.lua

local now = now_ms()
return {rl_acquire(ARGV[1], KEYS[1], KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5]),
  now, ARGV[4]), now}
