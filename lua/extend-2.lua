--[[ Renew a lease (heartbeat of a long call).
KEYS[1] active    KEYS[2] task
ARGV[1] task id   ARGV[2] lease token   ARGV[3] lease (ms)
Returns 1, or -1 when the lease was lost.
]]
--@include now.lua

if redis.call('HGET', KEYS[2], 'lease') ~= ARGV[2] then return -1 end
local deadline = now_ms() + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[1])
redis.call('HSET', KEYS[2], 'deadline', deadline)
return 1
