-- Task lifecycle (app/lifecycle). Every terminal transition copies the finished task into its
-- endpoint's outbox in the same script, so the copy SQL gets is atomic with the transition and
-- outlives the task's own TTL through a long SQL outage. Include now.lua first.

-- The fields of a task_results row, in the order the writer (app/lifecycle/results.py) reads.
local OUTBOX_FIELDS = {'user_id', 'type', 'status', 'result', 'result_status_code', 'attempts',
  'created_at', 'started_at', 'ended_at'}

local function to_outbox(outbox, task, id)
  local v = redis.call('HMGET', task, unpack(OUTBOX_FIELDS))
  local rec = {id = id}
  for i, name in ipairs(OUTBOX_FIELDS) do rec[name] = v[i] end
  redis.call('HSET', outbox, id, cjson.encode(rec))
end

-- A task still pending at its deadline never runs: `expired`, out of its queue, counted.
local function expire_pending(task, id, queue, stats, outbox, now)
  redis.call('ZREM', queue, id)
  redis.call('HSET', task, 'status', 'expired', 'ended_at', now)
  redis.call('HINCRBY', stats, 'expired', 1)
  to_outbox(outbox, task, id)
end
