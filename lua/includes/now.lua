-- The Redis clock in milliseconds: every replica agrees on it, whatever its own clock says.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Integers above 2^31 must not pass through tostring (it keeps 14 digits): format them.
local function int(n)
  return string.format('%.0f', n)
end
