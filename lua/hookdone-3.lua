--[[ A webhook delivered (or given up): it leaves the hooks ZSet, and its task gets the done
TTL that saved-1.lua held back, counted from when it ended, unless SQL has no row of it yet
(still in the outbox: saved-1.lua sets it then). A task that runs again (an operator's
retry) keeps the TTL it has: its next end brings a webhook of its own.
KEYS[1] task    KEYS[2] hooks (ZSet, see hookclaim-1.lua)    KEYS[3] outbox (ZSet)
ARGV[1] task id    ARGV[2] hook (when the task ended: it names the delivery)
ARGV[3] done TTL (ms)
Returns 1, or 0 when the task ended again meanwhile (that newer webhook stays due).
]]

local hook = redis.call('HGET', KEYS[1], 'hook')
if hook ~= ARGV[2] then
  if not hook then redis.call('ZREM', KEYS[2], ARGV[1]) end  -- nothing left to deliver
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], 'hook', 'hook_tries')
local status = redis.call('HGET', KEYS[1], 'status')
local ended = tonumber(redis.call('HGET', KEYS[1], 'ended_at'))
if ended and status ~= 'pending' and status ~= 'processing'
    and not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  redis.call('PEXPIREAT', KEYS[1], string.format('%.0f', ended + tonumber(ARGV[3])))
end
return 1
