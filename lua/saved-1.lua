--[[ Rows committed to SQL: their tasks leave the outbox and only now get the done TTL, counted
from when each ended (a task that ended during a long outage may go at once: SQL has it now,
and status reads it there). A task its owner read meanwhile has left the outbox already and
keeps its read TTL. A task whose webhook is still due keeps none: the webhook sender sets it
(hookdone-3.lua).
Only the ending the writer read leaves: a task retried and ended again since (its `ended_at`
no longer the one SQL got) stays in the outbox, and its new ending is written next.
KEYS[1] outbox (ZSet)    KEYS[2..] the tasks' hashes, in the order of ARGV's pairs
ARGV[1] done TTL (ms)    ARGV[2..] pairs: task id, its `ended_at` as the writer read it ('' for
none: a hash gone, or a task running again)
Returns how many left the outbox.
]]
local done, left = tonumber(ARGV[1]), 0
for i = 2, #KEYS do
  local id, seen = ARGV[2 * i - 2], ARGV[2 * i - 1]
  local task = KEYS[i]
  local ended = redis.call('HGET', task, 'ended_at')
  if (ended or '') == seen and redis.call('ZREM', KEYS[1], id) == 1 then
    left = left + 1
    local at = tonumber(ended)
    if at and redis.call('HEXISTS', task, 'hook') == 0 then
      redis.call('PEXPIREAT', task, at + done)
    end
  end
end
return left
