--[[ A submit on a Redis Cluster whose task is queued: its Idempotency-Key, taken for a moment
by reserve-2.lua, now holds for its whole TTL, if it still names this task.
KEYS[1] idem     ARGV[1] task id    ARGV[2] idempotency TTL (ms)
Returns 1, or 0 when the key names another task (this one's moment ran out first).
]]

if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
