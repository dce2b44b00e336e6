--[[ Rows committed to SQL: their tasks leave the outbox and only now get the done TTL, counted
from when each ended (a task that ended during a long outage may go at once: SQL has it now,
and status reads it there). A task its owner read meanwhile has left the outbox already and
keeps its read TTL. A task whose webhook is still due keeps none: the webhook sender sets it
(hookdone-3.lua).
KEYS[1] outbox (ZSet)    KEYS[2..] the tasks' hashes, one per id of ARGV[2..], in that order
ARGV[1] done TTL (ms)    ARGV[2..] task ids
Returns how many left the outbox.
]]
local done, left = tonumber(ARGV[1]), 0
for i = 2, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    left = left + 1
    local task = KEYS[i]
    local ended = tonumber(redis.call('HGET', task, 'ended_at'))
    if ended and redis.call('HEXISTS', task, 'hook') == 0 then
      redis.call('PEXPIREAT', task, ended + done)
    end
  end
end
return left
