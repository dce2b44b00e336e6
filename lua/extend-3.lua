--[[ Renew a lease (heartbeat of a long call).
KEYS[1] active    KEYS[2] task    KEYS[3] probe (upstream.lua): the probe's key, when this call
is the probe an upstream's pause lets through, lives as long as its lease, or the next claim
would send a second probe while the first is still on
ARGV[1] task id   ARGV[2] lease token   ARGV[3] lease (ms)
Returns 1, -1 when the lease was lost, or -2 when the task was cancelled meanwhile (the
dispatcher then aborts the call: the fallback for a cancel message it did not hear).
]]
--@include now.lua

local f = redis.call('HMGET', KEYS[2], 'lease', 'status')
if f[1] ~= ARGV[2] then return f[2] == 'cancelled' and -2 or -1 end
local deadline = now_ms() + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[1])
redis.call('HSET', KEYS[2], 'deadline', deadline)
if redis.call('GET', KEYS[3]) == ARGV[2] then redis.call('PEXPIRE', KEYS[3], ARGV[3]) end
return 1
