-- Per-endpoint counters, histograms and moving averages in the endpoint's stats hash, kept by
-- the scripts that make each transition: exact, and shared by every API and dispatcher process.
-- app/queue/stats.py reads them (one pipeline for every endpoint) for /metrics and the admin view.
--
-- Fields: counters `submitted admitted completed failed retried expired cancelled limited`,
-- `fail_<class>` (failed upstream calls by status class, stats_call_failed);
-- histograms `<name>:<bound ms>` (one bucket per observation, not cumulative: the reader adds
-- them up) + `<name>:inf` + `<name>:sum`; moving averages `exec_ms` (upstream call) and
-- `slot_ms` (claim to finish: how long a task holds a concurrency slot); 10-second rings
-- `<ring>:<i>` + `<ring>:t<i>` for recent rates; `fail:<i>` the last FAIL_KEEP failures.

-- Upper bounds (ms) of histogram buckets; app/queue/stats.py reads this line.
local STATS_BOUNDS_MS = {5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000, 1800000}
local RING_MS, RING_SLOTS, FAIL_KEEP = 10000, 8, 5

-- The whole milliseconds an observation counts for, and the field of its bucket.
local function stats_bucket(name, ms)
  ms = math.max(0, math.floor(ms))
  local bucket = 'inf'
  for _, bound in ipairs(STATS_BOUNDS_MS) do
    if ms <= bound then bucket = bound; break end
  end
  return ms, name .. ':' .. bucket
end

-- Observations counted in `tally` (field -> increment) over a script's run, written by
-- stats_flush at its end: one HINCRBY a field touched, not two commands an observation.
local function stats_tally(tally, name, ms)
  local field
  ms, field = stats_bucket(name, ms)
  tally[field] = (tally[field] or 0) + 1
  tally[name .. ':sum'] = (tally[name .. ':sum'] or 0) + ms
end

local function stats_flush(stats, tally)
  for field, n in pairs(tally) do redis.call('HINCRBY', stats, field, n) end
end

local function stats_observe(stats, name, ms)
  local field
  ms, field = stats_bucket(name, ms)
  redis.call('HINCRBY', stats, field, 1)
  redis.call('HINCRBY', stats, name .. ':sum', ms)
end

-- Count `n` events of `ring` in the 10-second slot of `now`; a slot left from an older lap is
-- reset first, so a ring never holds more than RING_SLOTS * RING_MS of history.
local function stats_tick(stats, ring, now, n)
  local slot = math.floor(now / RING_MS)
  local i = slot % RING_SLOTS
  if tonumber(redis.call('HGET', stats, ring .. ':t' .. i)) ~= slot then
    redis.call('HSET', stats, ring .. ':t' .. i, slot, ring .. ':' .. i, 0)
  end
  redis.call('HINCRBY', stats, ring .. ':' .. i, n)
end

-- An upstream call that failed (to be retried or for good): counted by the class of its HTTP
-- status ('none': no answer, such as a timeout or a refused connection, or an unusual code)
-- and timed beside the successful calls' `upstream_ms`, since slow failures are the ones
-- that hold slots. stats_tally_failed counts one in a tally, stats_call_failed writes it.
local function stats_tally_failed(tally, code, ms)
  local class = 'none'
  code = tonumber(code)
  if code and code >= 200 and code < 600 then class = math.floor(code / 100) .. 'xx' end
  tally['fail_' .. class] = (tally['fail_' .. class] or 0) + 1
  stats_tally(tally, 'upstream_failed_ms', ms)
end

local function stats_call_failed(stats, code, ms)
  local tally = {}
  stats_tally_failed(tally, code, ms)
  -- Not through stats_flush: a key reaches redis.call from the function given it (the key
  -- guard of tests/test_scale_out.py follows one such step).
  for field, n in pairs(tally) do redis.call('HINCRBY', stats, field, n) end
end

-- Moving average of recent values, in order (each new one weighs a tenth): one read and one
-- write for them all.
local function stats_ema_many(stats, field, values)
  if #values == 0 then return end
  local avg = tonumber(redis.call('HGET', stats, field) or values[1])
  for _, v in ipairs(values) do avg = avg * 0.9 + v * 0.1 end
  redis.call('HSET', stats, field, string.format('%.1f', avg))
end

local function stats_ema(stats, field, value)
  stats_ema_many(stats, field, {value})
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
