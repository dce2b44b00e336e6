-- Task lifecycle (app/lifecycle). Every terminal transition puts the finished task's id in its
-- endpoint's outbox (a ZSet, score = when it ended) in the same script, and takes the task's
-- TTL away: the task hash itself is the record SQL gets, and it stays until SQL has its row,
-- however long an outage lasts; the writer sets the done TTL then (lua/saved-1.lua). No copy
-- of a result is made here: an 8 MB answer is neither doubled in Redis nor JSON-encoded inside
-- the script that acks it. Include now.lua first.

local function to_outbox(outbox, task, id, now)
  redis.call('PERSIST', task)
  redis.call('ZADD', outbox, now, id)
end

-- A task still pending at its deadline never runs: `expired`, out of its queue, counted.
local function expire_pending(task, id, queue, stats, outbox, now)
  redis.call('ZREM', queue, id)
  redis.call('HSET', task, 'status', 'expired', 'ended_at', now)
  redis.call('HINCRBY', stats, 'expired', 1)
  to_outbox(outbox, task, id, now)
end
