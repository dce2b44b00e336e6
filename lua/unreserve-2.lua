--[[ Give back what reserve-2.lua took for a task that was not queued (its queue was full, its
endpoint gone): the Idempotency-Key, if it still names this task, and one of today's quota.
KEYS[1] idem     KEYS[2] quota
ARGV[1] task id  ARGV[2] '1' if KEYS[1] was taken
ARGV[3] the end of the day reserve-2.lua counted the task in (ms; 0 = none counted)
]]

if ARGV[2] == '1' and redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
-- Only that day's count: the counter of a new day has nothing of this task's.
if tonumber(ARGV[3]) > 0 and redis.call('PEXPIRETIME', KEYS[2]) == tonumber(ARGV[3])
    and tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then
  redis.call('DECR', KEYS[2])
end
return 1
