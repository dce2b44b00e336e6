--[[ Count one use of an online permit whose signature the caller has already verified.
The permit is live while its task is admitted ('processing') under the same admission (the
deadline signed into the permit is still the task's deadline); cancel, complete and expiry end it.
KEYS[1] task
ARGV[1] deadline signed into the permit (ms)    ARGV[2] max uses
Returns 1 (let the call through) or 0.
]]

local f = redis.call('HMGET', KEYS[1], 'status', 'deadline', 'type')
if f[1] ~= 'processing' or f[3] ~= 'online' or f[2] ~= ARGV[1] then return 0 end
if redis.call('HINCRBY', KEYS[1], 'permit_uses', 1) > tonumber(ARGV[2]) then return 0 end
return 1
