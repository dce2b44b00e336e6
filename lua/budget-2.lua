--[[ Keep what the upstream said remains of its limit before its reset (x-ratelimit-remaining-*,
app/queue/signals.py `remaining`): the claim admits no more calls than that until the reset
(upstream.lua upstream_budget), on every dispatcher.
KEYS[1] stats    KEYS[2] active
ARGV[1] calls the upstream said remain    ARGV[2] ms until its reset
Sent right after the acks of the answers that told it (app/queue/acks.py), so the calls still in
flight are those of KEYS[2]: the count may not include them yet, and they are taken off it.
]]
--@include now.lua
--@include upstream.lua

local now = now_ms()
upstream_budget_told(KEYS[1], now, tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[2]),
  now + tonumber(ARGV[2]))
return 1
