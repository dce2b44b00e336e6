--[[ The task waiting longest in a queue, for the admin view. Strict priority lets a lower band
wait behind a higher one, so the oldest task is the oldest of the band heads (within a band
the queue is in arrival order). Bands are visited from the lowest priority up, where waiting
is longest, at most ARGV[1] of them: two lookups a band (its top score names the band, then
its head).
KEYS[1] queue    ARGV[1] most bands to look at
Returns the id of the oldest band head seen (ids begin with their creation ms), or false.
]]
--@include now.lua

local BAND = 8796093022208  -- 2^43, one priority step of the score (submit-11.lua)
local hi, left = '+inf', tonumber(ARGV[1])
local best, best_ms = false, nil
while left > 0 do
  left = left - 1
  local top = redis.call('ZREVRANGEBYSCORE', KEYS[1], hi, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #top == 0 then break end
  local score = tonumber(top[2])
  -- Priority p holds the scores in [-p * BAND, -(p - 1) * BAND), priority 0 those from 0 up:
  -- a band's start plus an offset under BAND (submit-11.lua; a fair turn 0 is the start itself,
  -- lua/includes/fairness.lua).
  local priority = 0
  if score <= 0 then priority = math.ceil(-score / BAND) end
  local floor = int(-priority * BAND)
  local head = redis.call('ZRANGEBYSCORE', KEYS[1], floor, hi, 'LIMIT', 0, 1)
  local ms = tonumber(string.sub(head[1], 1, 12), 16)
  if ms and (not best_ms or ms < best_ms) then best, best_ms = head[1], ms end
  hi = '(' .. floor
end
return best
