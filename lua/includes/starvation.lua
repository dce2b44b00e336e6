-- Bounded starvation (endpoint `max_starvation_s`): a task waiting longer than the bound is
-- served before higher priorities. Submit adds each task of such an endpoint to an arrival-
-- ordered index (Keys.arrivals: id -> arrival ms) beside its queue; the claim takes a task off
-- it when it claims it, and an entry whose task left the queue otherwise (cancelled, expired,
-- purged, or claimed while no bound was set) goes when the claim meets it at the front.
-- The queue itself is unchanged, so wait_num stays its ZRANK (a rank by priority: a task
-- served early by the bound only ever leaves sooner than its rank said).

-- How many entries of the index one claim looks at, at most: stale ones it drops, the rest
-- it serves first.
local STARVE_SCAN = 100

-- The ids, oldest first, of at most `n` tasks still in `queue` that arrived at or before
-- `cutoff` (ms): one ZRANGEBYSCORE of the index, and a ZSCORE each to tell a waiting task from
-- a stale entry.
local function starving(arrivals, queue, cutoff, n)
  local out = {}
  local ids = redis.call('ZRANGEBYSCORE', arrivals, '-inf', cutoff, 'LIMIT', 0, STARVE_SCAN)
  for _, id in ipairs(ids) do
    if #out >= n then break end
    if redis.call('ZSCORE', queue, id) then out[#out + 1] = id
    else redis.call('ZREM', arrivals, id) end
  end
  return out
end

-- A task handed back to its queue (release, reap, a refusal given back, a retry due, an
-- operator's retry) goes back into the index at its first arrival: the claim took it off,
-- and its wait counts from when it came, not from its hand-back (a task claimed and given
-- back again and again would otherwise never be overdue). `arrivals` nil: no bound, nothing.
local function starve_back(arrivals, task, id)
  if not arrivals then return end
  local f = redis.call('HMGET', task, 'arrived_at', 'created_at')
  local at = tonumber(f[1]) or tonumber(f[2])
  if at then redis.call('ZADD', arrivals, at, id) end
end
