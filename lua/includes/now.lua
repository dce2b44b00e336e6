-- The Redis clock in milliseconds: every replica agrees on it, whatever its own clock says.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- When a task ends: the Redis clock, but always after an earlier ending of the same task
-- (`before`: its `ended_before`, which an operator's retry keeps, requeue-7.lua and revive-5.lua).
-- A failover to a master whose clock is behind must not make a newer ending look older: SQL
-- keeps a task's newest ending by this time, and the outbox writer lets a task go only while
-- its `ended_at` is still the one it wrote (lua/saved-1.lua).
local function ending_ms(before, now)
  before = tonumber(before)
  if before and before >= now then return before + 1 end
  return now
end

-- Integers above 2^31 must not pass through tostring (it keeps 14 digits): format them.
local function int(n)
  return string.format('%.0f', n)
end
