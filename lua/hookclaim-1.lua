--[[ Take an endpoint's webhooks that are due, with a lease: each one's score moves to now +
lease in the same script, so a sender that dies mid-delivery loses nothing (another takes it
once the lease has run out), as a claim does with a task.
KEYS[1] hooks  ZSet of task ids whose webhook is due; score = when (ms, Redis clock)
ARGV[1] lease (ms)    ARGV[2] most ids to take
Returns {lease deadline, id, ...}: the deadline is the lease's token (hookretry-2.lua).
]]
--@include now.lua

local now = now_ms()
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local deadline = now + tonumber(ARGV[1])
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], 'XX', int(deadline), id)
end
table.insert(ids, 1, deadline)
return ids
