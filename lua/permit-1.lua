--[[ Count one use of an online permit whose signature the caller has already verified.
The permit is live until the deadline signed into it, on the Redis clock (an API host's own
clock, ahead or behind, must neither refuse a fresh permit nor pass a stale one), and while
its task is admitted ('processing') under the same admission (that deadline is still the
task's deadline); cancel, complete and expiry end it.
KEYS[1] task
ARGV[1] deadline signed into the permit (ms)    ARGV[2] max uses
Returns 1 (let the call through), 0 (ended, revoked or used up) or -1 (expired).
]]
--@include now.lua

if now_ms() >= tonumber(ARGV[1]) then return -1 end
local f = redis.call('HMGET', KEYS[1], 'status', 'deadline', 'type')
if f[1] ~= 'processing' or f[3] ~= 'online' or f[2] ~= ARGV[1] then return 0 end
if redis.call('HINCRBY', KEYS[1], 'permit_uses', 1) > tonumber(ARGV[2]) then return 0 end
return 1
