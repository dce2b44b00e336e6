--[[ A delivery failed: due again after a back-off, if this sender still holds its lease and
the webhook is still the one it tried (the task did not end again meanwhile).
KEYS[1] task    KEYS[2] hooks (ZSet, see hookclaim-1.lua)
ARGV[1] task id    ARGV[2] hook (when the task ended: it names the delivery)
ARGV[3] lease deadline its claim returned    ARGV[4] back-off (ms)
ARGV[5] '0': not a try, only put back (its receiver was busy or resting); absent: a try
Returns 1, or 0 when another sender (its lease ran out) or a newer end owns it now.
]]
--@include now.lua

if redis.call('HGET', KEYS[1], 'hook') ~= ARGV[2] then return 0 end
if tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1])) ~= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[2], int(now_ms() + tonumber(ARGV[4])), ARGV[1])
if ARGV[5] ~= '0' then redis.call('HINCRBY', KEYS[1], 'hook_tries', 1) end
return 1
