--[[ The task waiting longest in a queue, for the admin view. Strict priority lets a lower band
wait behind a higher one, so the oldest task is the oldest of the band heads (within a band
the queue is in arrival order): look at the head of each band, jumping from band to band, as
expire-3.lua does. Bounded by ARGV[1] bands.
KEYS[1] queue    ARGV[1] most bands to look at
Returns the id of the oldest band head seen (ids begin with their creation ms), or false.
]]
--@include now.lua

local BAND = 8796093022208  -- 2^43, one priority step of the score (submit-6.lua)
local from, left = '-inf', tonumber(ARGV[1])
local best, best_ms = false, nil
while left > 0 do
  left = left - 1
  local head = redis.call('ZRANGEBYSCORE', KEYS[1], from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #head == 0 then break end
  local id, score = head[1], tonumber(head[2])
  local ms = tonumber(string.sub(id, 1, 12), 16)
  if ms and (not best_ms or ms < best_ms) then best, best_ms = id, ms end
  if score > 0 then break end  -- priority 0 is the last band
  local priority = math.ceil(-score / BAND)
  from = int(-(priority - 1) * BAND + 1)
end
return best
