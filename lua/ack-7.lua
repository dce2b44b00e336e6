--[[ Finish claimed tasks of one endpoint, each if its caller still holds its lease: the acks of
one event-loop turn in one call (app/queue/acks.py), their stats written once for all.
KEYS[1] active    KEYS[2] queue    KEYS[3] wake    KEYS[4] stats    KEYS[5] outbox
KEYS[6] hooks (lifecycle.lua)    KEYS[7] probe (upstream.lua)
KEYS[8..] the further limits' state and pace keys, two per limit of ARGV[4..] (limits.lua),
then, with further limits, the callers' real costs (costs.lua), then the tasks' hashes, one per
task of ARGV, in that order
ARGV[1] endpoint id
ARGV[2] 'claims' when the caller runs claim-12.lua for this endpoint right after, in the same
pipeline (it then leaves the wake marker to that claim); anything else: the marker is added here
ARGV[3] how many tasks
ARGV[4] how many further limits settle (0 = none), then kind, rate, interval, guard, per each,
as claim-12.lua takes them (ARGV[12..]): the per-cost ones settle a task's reservation (its
`cost` field) to its real cost
then nine values a task: id, lease token, final status ('completed' | 'failed'), result,
result status code ('' if none), exec time of the last attempt (ms; -1 = no call made), the
pause the upstream asked for (ms; 0 = none, see upstream.lua), the call's real cost ('' =
unknown: nothing settles), the answer's meta (JSON, app/queue/answers.py; '' = no answer kept)
Returns {1 when tasks still wait in the queue else 0, then per task 1, or 0 when its lease was
lost (reaped and claimed again: the newer attempt wins)}.
Finished tasks go to the endpoint's outbox (see lua/includes/lifecycle.lua).
]]
--@include now.lua
--@include stats.lua
--@include upstream.lua
--@include events.lua
--@include ratelimit.lua
--@include limits.lua
--@include adaptive.lua
--@include costs.lua

local active, queue, stats, probe = KEYS[1], KEYS[2], KEYS[4], KEYS[7]
local n, nlim = tonumber(ARGV[3]), tonumber(ARGV[4])
local rc = nlim > 0 and KEYS[8 + 2 * nlim] or nil  -- costs.lua
local first_task, first_arg = (rc and 9 or 8) + 2 * nlim, 5 + 5 * nlim
local now = now_ms()
local limits = nil  -- parsed when a task has a real cost to settle
local probing = redis.call('GET', probe)  -- the probe's lease token, if one is out
local out, ended = {0}, {}
local count = {completed = 0, failed = 0}
local exec_ms, slot_ms = {}, {}  -- for the moving averages, in order
local tally = {}  -- histogram and failure-class fields (stats_tally), written once at the end
local failures = {}
local samples = {}  -- adaptive.lua

for i = 0, n - 1 do
  local a, task = first_arg + 9 * i, KEYS[first_task + i]
  local id, token, status = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local f = redis.call('HMGET', task, 'lease', 'started_at', 'cost', 'callback_url', 'user_id',
    'ended_before')
  if f[1] ~= token then
    out[#out + 1] = 0
  else
    out[#out + 1] = 1
    local started, real = tonumber(f[2]), tonumber(ARGV[a + 7])
    if real and nlim > 0 then
      limits = limits or lim_parse(ARGV, 4, KEYS, 8)
      for _, l in ipairs(limits) do
        lim_settle(l, token, tonumber(f[3]) or 1, real, started or now, now)
      end
      -- What this caller's calls really cost, for its next reservations (claim-12.lua); an
      -- absurd figure counts as the largest limit's whole rate, as its settle does, or one
      -- answer would hold the caller to a call an interval for hundreds of calls.
      if status == 'completed' then
        local most = 1
        for _, l in ipairs(limits) do if l.rate > most then most = l.rate end end
        rc_note(rc, f[5] or '', math.min(real, most), now)
      end
    end
    local pause = tonumber(ARGV[a + 6]) or 0
    if pause > 0 then
      upstream_pause(stats, probe, now, pause)
      probing = false
    elseif probing == token then
      upstream_call_ended(stats, probe, token, status == 'completed')
      probing = false
    end
    -- Each task whole before the next (a call failing half-way leaves the ones before it
    -- finished, the rest leased as they were). To the outbox as lifecycle.lua's to_outbox,
    -- but no PERSIST: a leased task has no TTL to take away (the claim took it, and nothing
    -- sets one while it runs).
    local ending = ending_ms(f[6], now)
    redis.call('ZREM', active, id)
    redis.call('ZADD', KEYS[5], ending, id)
    redis.call('HSET', task, 'status', status, 'result', ARGV[a + 3],
      'result_status_code', ARGV[a + 4], 'ended_at', ending, 'result_meta', ARGV[a + 8])
    if f[4] then  -- its webhook is due (lifecycle.lua)
      redis.call('HSET', task, 'hook', ending, 'hook_tries', 0)
      redis.call('ZADD', KEYS[6], now, id)  -- due now, whatever its `ended_at` says
    end
    redis.call('HDEL', task, 'lease', 'deadline')
    ended[#ended + 1] = id
    count[status] = count[status] + 1
    local exec = tonumber(ARGV[a + 5])
    adaptive_note(samples, status, ARGV[a + 4], exec, started)
    if status == 'completed' and exec >= 0 then
      exec_ms[#exec_ms + 1] = exec
      stats_tally(tally, 'upstream_ms', exec)
    elseif status == 'failed' then
      failures[#failures + 1] = {id, ARGV[a + 4], ARGV[a + 3]}
      if exec >= 0 then stats_tally_failed(tally, ARGV[a + 4], exec) end
    end
    -- How long it held its slot, claim to here (stats.lua `slot_ms`): the wait estimate's.
    if started then slot_ms[#slot_ms + 1] = now - started end
  end
end

if #ended > 0 then
  publish_changed(active, ended)
  if count.completed > 0 then redis.call('HINCRBY', stats, 'completed', count.completed) end
  if count.failed > 0 then
    local total = redis.call('HINCRBY', stats, 'failed', count.failed)
    for i, x in ipairs(failures) do
      stats_failure(stats, total - #failures + i, now, x[1], x[2], x[3])
    end
  end
  stats_flush(stats, tally)
  stats_ema_many(stats, 'exec_ms', exec_ms)
  stats_ema_many(stats, 'slot_ms', slot_ms)
  stats_tick(stats, 'done', now, #ended)
  adaptive_update(stats, now, samples, active)
end
if redis.call('ZCARD', queue) == 0 then return out end
out[1] = 1
if ARGV[2] ~= 'claims' then
  redis.call('ZADD', KEYS[3], 'NX', now, ARGV[1])  -- a slot is free: worth a claim
end
return out
