--[[ Renew a lease (heartbeat of a long call), and count a retry when asked.
KEYS[1] active    KEYS[2] task
ARGV[1] task id   ARGV[2] lease token   ARGV[3] lease (ms)   ARGV[4] attempts to add
A retry (ARGV[4] > 0) is counted in the endpoint's stats (found from KEYS[1], stats.lua).
Returns the attempt count, or -1 when the lease was lost.
]]
--@include now.lua
--@include stats.lua

if redis.call('HGET', KEYS[2], 'lease') ~= ARGV[2] then return -1 end
local deadline = now_ms() + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[1])
redis.call('HSET', KEYS[2], 'deadline', deadline)
if tonumber(ARGV[4]) > 0 then
  redis.call('HINCRBY', sibling_key(KEYS[1], 'stats'), 'retried', tonumber(ARGV[4]))
end
return redis.call('HINCRBY', KEYS[2], 'attempts', tonumber(ARGV[4]))
