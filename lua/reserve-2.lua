--[[ A submit's first step on a Redis Cluster, in the caller's slot (its keys carry the user's
tag, the queue the endpoint's): the Idempotency-Key and the daily quota, taken before the task
is queued (submit-11.lua, with both off) and given back (unreserve-2.lua) if it is not.
Counting first keeps the quota exact under races: the count is checked and taken at once.
KEYS[1] idem     KEYS[2] quota (see submit-11.lua)
ARGV[1] task id  ARGV[2] '1' to honour KEYS[1]
ARGV[3] how long the key holds before confirm-1.lua gives it its whole TTL (ms): a task whose
queueing failed frees its key by itself
ARGV[4] daily quota (0 = none)
Returns {'ok', end of the counted day (ms, 0 = none counted)} |
{'dup', first task id, ms its key has left} | {'quota', ms until the quota resets}
]]
--@include now.lua

if ARGV[2] == '1' then
  local first = redis.call('GET', KEYS[1])
  if first then return {'dup', first, redis.call('PTTL', KEYS[1])} end
end
local quota, day_end = tonumber(ARGV[4]), 0
if quota > 0 then
  if tonumber(redis.call('GET', KEYS[2]) or '0') >= quota then
    return {'quota', redis.call('PTTL', KEYS[2])}
  end
  day_end = (math.floor(now_ms() / 86400000) + 1) * 86400000
  if redis.call('INCR', KEYS[2]) == 1 then redis.call('PEXPIREAT', KEYS[2], int(day_end)) end
end
if ARGV[2] == '1' then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3]) end
return {'ok', int(day_end)}
