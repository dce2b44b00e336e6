-- Task lifecycle (app/lifecycle). Every terminal transition ends the task through `to_outbox`
-- in the same script: its fields (status, result) and `ended_at` written, its id put in its
-- endpoint's outbox (a ZSet, score = when it ended), its TTL taken away. The task hash itself
-- is the record SQL gets, and it stays until SQL has its row, however long an outage lasts;
-- the writer sets the done TTL then (lua/saved-1.lua). No copy of a result is made here: an
-- 8 MB answer is neither doubled in Redis nor JSON-encoded inside the script that acks it.
-- Include now.lua first.
--
-- `ended_at` is the clock's now, but after any earlier ending of the task (now.lua ending_ms).
-- A task with a `callback_url` also gets its webhook due now, in the endpoint's `hooks` ZSet
-- beside the outbox (same hash tag, same slot; the caller passes it), and the field `hook` =
-- when it ended, which names the delivery (app/queue/webhooks.py) and keeps the task in Redis
-- until the webhook is delivered or given up (saved-1.lua and status-6.lua set no TTL while it
-- is there). `...`: the ending's field, value pairs. Returns when the task ended.
local function to_outbox(outbox, hooks, task, id, now, ...)
  local f = redis.call('HMGET', task, 'ended_before', 'callback_url')
  local ended = ending_ms(f[1], now)
  redis.call('PERSIST', task)
  redis.call('ZADD', outbox, ended, id)
  if f[2] then
    redis.call('HSET', task, 'ended_at', ended, 'hook', ended, 'hook_tries', 0, ...)
    redis.call('ZADD', hooks, now, id)  -- due now, whatever its `ended_at` says
  else
    redis.call('HSET', task, 'ended_at', ended, ...)
  end
  return ended
end

-- A task still pending at its deadline never runs: `expired`, out of its queue, counted.
local function expire_pending(task, id, queue, stats, outbox, hooks, now)
  redis.call('ZREM', queue, id)
  redis.call('HINCRBY', stats, 'expired', 1)
  to_outbox(outbox, hooks, task, id, now, 'status', 'expired')
end
