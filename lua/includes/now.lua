-- The Redis clock in milliseconds: every replica agrees on it, whatever its own clock says.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Integers above 2^31 must not pass through tostring (it keeps 14 digits): format them.
local function int(n)
  return string.format('%.0f', n)
end

-- redis.call(cmd, key, ...) over a list of arguments, in chunks of `step` (a multiple of the
-- arguments a member takes: 2 for ZADD's score and member): unpack takes at most a few
-- thousand values, and a claim or an ack batch may hold more.
local function call_many(cmd, key, list, step)
  for i = 1, #list, step do
    redis.call(cmd, key, unpack(list, i, math.min(i + step - 1, #list)))
  end
end
