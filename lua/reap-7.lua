--[[ Return claims whose lease ran out to their queue, with their original score.
Safe in many processes at once: each expired id is handled by whichever script runs first.
KEYS[1] active    KEYS[2] queue    KEYS[3] wake    KEYS[4] stats    KEYS[5] outbox
KEYS[6] hooks (lifecycle.lua)    KEYS[7] probe (upstream.lua): a probe reaped is no probe any
more; the next claim sends another
KEYS[8..] arrivals (only for an endpoint with max_starvation_s): a task requeued goes back into
it at its first arrival (starvation.lua)
ARGV[1] endpoint id    ARGV[2] task key prefix    ARGV[3] max attempts
ARGV[4] unused (the done TTL: set once SQL has the row)    ARGV[5] batch size
Returns {requeued, failed, ended online}. Ended tasks go to the endpoint's outbox.
Task hashes of ids read here are built from ARGV[2] (prefix), same hash tag.
]]
--@include now.lua
--@include lifecycle.lua
--@include stats.lua
--@include events.lua
--@include upstream.lua
--@include starvation.lua

local now = now_ms()
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[5]))
local requeued, failed, ended = 0, 0, 0
local outbox, hooks = KEYS[5], KEYS[6]
local changed = {}
local arrivals = unpack(KEYS, 8)
for _, id in ipairs(ids) do
  -- Read before writing: while a Cluster reshard moves this slot, a key not yet here fails
  -- the script, and what it already wrote stays (Redis does not roll back).
  local task = ARGV[2] .. id
  local fields = redis.call('HMGET', task, 'type', 'attempts', 'score', 'status', 'started_at',
    'lease')
  if not fields[1] then
    -- A leased task's hash has no TTL, so it is not gone but not here yet: a reshard moving
    -- this slot key by key, this script run on the new master before the hash came. Looked at
    -- again in a minute; dropped now, the task would arrive "processing" and never run.
    redis.call('ZADD', KEYS[1], now + 60000, id)
  else
    redis.call('ZREM', KEYS[1], id)
  end
  if fields[1] and fields[4] == 'processing' then
    redis.call('HDEL', task, 'lease', 'deadline')
    if fields[6] then upstream_call_ended(KEYS[4], KEYS[7], fields[6], false) end
    changed[#changed + 1] = id
    if fields[1] == 'proxy' then
      -- The process relaying it stopped renewing (killed mid-stream): its caller is gone with it,
      -- so it never runs again.
      local n = redis.call('HINCRBY', KEYS[4], 'failed', 1)
      stats_failure(KEYS[4], n, now, id, '', 'caller connection lost')
      to_outbox(outbox, hooks, task, id, now, 'status', 'failed',
        'result', 'caller connection lost')
      failed = failed + 1
    elseif fields[1] == 'online' then
      -- The permit lapsed without `complete`: the slot is free again.
      redis.call('HINCRBY', KEYS[4], 'expired', 1)
      if tonumber(fields[5]) then stats_ema(KEYS[4], 'slot_ms', now - tonumber(fields[5])) end
      to_outbox(outbox, hooks, task, id, now, 'status', 'expired')
      ended = ended + 1
    elseif tonumber(fields[2]) >= tonumber(ARGV[3]) then
      local n = redis.call('HINCRBY', KEYS[4], 'failed', 1)
      stats_failure(KEYS[4], n, now, id, '', 'lease expired on attempt ' .. fields[2])
      to_outbox(outbox, hooks, task, id, now, 'status', 'failed',
        'result', 'lease expired on attempt ' .. fields[2] .. ': the dispatcher stopped answering')
      failed = failed + 1
    else
      redis.call('HSET', task, 'status', 'pending')
      redis.call('ZADD', KEYS[2], fields[3], id)
      starve_back(arrivals, task, id)
      redis.call('HINCRBY', KEYS[4], 'retried', 1)
      requeued = requeued + 1
    end
  end
end
if #ids > 0 and redis.call('ZCARD', KEYS[2]) > 0 then
  redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1])
end
publish_changed(KEYS[1], changed)
return {requeued, failed, ended}
