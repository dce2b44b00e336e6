-- Per-endpoint counters, histograms and moving averages in the endpoint's stats hash, kept by
-- the scripts that make each transition: exact, and shared by every API and dispatcher process.
-- app/queue/stats.py reads them (one pipeline for every endpoint) for /metrics and the admin view.
--
-- Fields: counters `submitted admitted completed failed retried expired cancelled limited`,
-- `fail_<class>` (failed upstream calls by status class, sb_call_failed);
-- histograms `<name>:<bound ms>` (one bucket per observation, not cumulative: the reader adds
-- them up) + `<name>:inf` + `<name>:sum`; moving averages `exec_ms` (upstream call) and
-- `slot_ms` (claim to finish: how long a task holds a concurrency slot); 10-second rings
-- `<ring>:<i>` + `<ring>:t<i>` for recent rates; `fail:<i>` the last FAIL_KEEP failures.

-- Upper bounds (ms) of histogram buckets; app/queue/stats.py reads this line.
local STATS_BOUNDS_MS = {5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000, 1800000}
local RING_MS, RING_SLOTS, FAIL_KEEP = 10000, 8, 5

-- A sibling key of `key` (any key of the same endpoint, '<prefix>:{e}:<name>'): same hash tag,
-- same Cluster slot. Scripts whose callers do not pass the stats hash find it this way.
local function sibling_key(key, name)
  return (string.gsub(key, '}:[^}]*$', '}:' .. name))
end

-- The updates a script makes to one stats hash, gathered (stats_batch, then sb_* calls) and
-- applied by stats_flush with one HMGET and one HSET: a processed task's bookkeeping costs
-- two commands instead of one or two per counter, bucket, ring and average. As exact as
-- HINCRBY, since nothing runs between a script's read and its write.
local function stats_batch(stats)
  return {key = stats, add = {}, ema = {}, set = {}, rings = {}}
end

local function sb_add(b, field, n)
  b.add[field] = (b.add[field] or 0) + n
end

local function sb_observe(b, name, ms)
  ms = math.max(0, math.floor(ms))
  local bucket = 'inf'
  for _, bound in ipairs(STATS_BOUNDS_MS) do
    if ms <= bound then bucket = bound; break end
  end
  sb_add(b, name .. ':' .. bucket, 1)
  sb_add(b, name .. ':sum', ms)
end

-- Count `n` events of `ring` in the 10-second slot of `now`; a slot left from an older lap is
-- reset first, so a ring never holds more than RING_SLOTS * RING_MS of history.
local function sb_tick(b, ring, now, n)
  local slot = math.floor(now / RING_MS)
  local i = slot % RING_SLOTS
  b.rings[#b.rings + 1] = {ring .. ':' .. i, ring .. ':t' .. i, slot}
  sb_add(b, ring .. ':' .. i, n)
end

-- Moving average of recent values (each new one weighs a tenth).
local function sb_ema(b, field, value)
  b.ema[field] = value
end

-- An upstream call that failed (to be retried or for good): counted by the class of its HTTP
-- status ('none': no answer, such as a timeout or a refused connection, or an unusual code)
-- and timed beside the successful calls' `upstream_ms`, since slow failures are the ones
-- that hold slots.
local function sb_call_failed(b, code, ms)
  local class = 'none'
  code = tonumber(code)
  if code and code >= 200 and code < 600 then class = math.floor(code / 100) .. 'xx' end
  sb_add(b, 'fail_' .. class, 1)
  sb_observe(b, 'upstream_failed_ms', ms)
end

-- Apply a batch; returns the new value of each counter (field -> number).
local function stats_flush(b)
  local fields, at = {}, {}
  local function want(f)
    if not at[f] then fields[#fields + 1] = f; at[f] = #fields end
  end
  for f in pairs(b.add) do want(f) end
  for f in pairs(b.ema) do want(f) end
  for _, r in ipairs(b.rings) do want(r[2]) end
  local old = {}
  if #fields > 0 then old = redis.call('HMGET', b.key, unpack(fields)) end
  local reset = {}
  for _, r in ipairs(b.rings) do
    if tonumber(old[at[r[2]]]) ~= r[3] then reset[r[1]] = true; b.set[r[2]] = r[3] end
  end
  local new, args = {}, {}
  for f, n in pairs(b.add) do
    local v = n
    if not reset[f] then v = v + (tonumber(old[at[f]]) or 0) end
    new[f] = v
    args[#args + 1] = f; args[#args + 1] = string.format('%d', v)
  end
  for f, v in pairs(b.ema) do
    local avg = tonumber(old[at[f]]) or v
    args[#args + 1] = f; args[#args + 1] = string.format('%.1f', avg * 0.9 + v * 0.1)
  end
  for f, v in pairs(b.set) do
    args[#args + 1] = f; args[#args + 1] = v
  end
  if #args > 0 then redis.call('HSET', b.key, unpack(args)) end
  return new
end

-- sb_ema at once, for a script with nothing else to count.
local function stats_ema(stats, field, value)
  local avg = tonumber(redis.call('HGET', stats, field) or value)
  redis.call('HSET', stats, field, string.format('%.1f', avg * 0.9 + value * 0.1))
end

-- Remember a failure for the dashboard: the `n`th failure overwrites the one FAIL_KEEP before.
local function stats_failure(stats, n, now, id, code, reason)
  reason = reason or ''
  if #reason > 200 then  -- cut on a character boundary: the reader decodes UTF-8
    reason = string.gsub(string.sub(reason, 1, 200), '[\192-\255][\128-\191]*$', '')
  end
  redis.call('HSET', stats, 'fail:' .. (n % FAIL_KEEP),
    cjson.encode({at = now, task_id = id, code = tonumber(code), reason = reason}))
end
