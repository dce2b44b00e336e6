--[[ Expire tasks still pending past their deadline (`pexp`, set at submit): they leave their
queue and never run. No extra index: within one priority the queue is in arrival order, which
is deadline order, so the script looks at the head of each priority band and jumps to the next
band at the first task not yet due. A task handed back after a claim has no deadline, and one
an operator retried (`dl` 2) has a later one than tasks behind it, kept in the deadline set:
the walk steps past both, past at most RETRIED_PER_BAND retried ones a band (a bulk retry of
thousands must not take every step of every run, nor keep the walk from the bands below).
Bounded: at most ARGV[3] expirations and ARGV[4] steps.
KEYS[1] queue    KEYS[2] stats    KEYS[3] outbox    KEYS[4] deadlines    KEYS[5] hooks
ARGV[1] task key prefix    ARGV[2] unused (the done TTL: set once SQL has the row)    ARGV[3] max expirations    ARGV[4] max steps
Returns {expired, 1 if it stopped at a bound (more may be due) else 0}.
Task hashes of ids read here are built from ARGV[1] (prefix), same hash tag.
]]
--@include now.lua
--@include lifecycle.lua
--@include stats.lua
--@include events.lua

local BAND = 8796093022208  -- 2^43, one priority step of the score (submit-11.lua)
local RETRIED_PER_BAND = 32
local now = now_ms()
local max_expired, steps_left = tonumber(ARGV[3]), tonumber(ARGV[4])
local from, expired, retried = '-inf', 0, 0
local changed = {}

local function done(more)
  publish_changed(KEYS[1], changed)
  return {expired, more}
end

-- Tasks with a deadline of their caller's (max_wait_s, submit-11.lua), and every task of a
-- per_user endpoint (its bands are in turn order, lua/includes/fairness.lua), may be due before
-- tasks ahead of them in their band: their own set names them. Entries of tasks that started or
-- ended meanwhile are dropped on the way.
local deadlines = KEYS[4]
for _, id in ipairs(redis.call('ZRANGEBYSCORE', deadlines, '-inf', now, 'LIMIT', 0, max_expired)) do
  local task = ARGV[1] .. id
  local f = redis.call('HMGET', task, 'status', 'pexp')  -- before writing (reap-7.lua)
  redis.call('ZREM', deadlines, id)
  if f[1] == 'pending' and f[2] and tonumber(f[2]) <= now then
    expire_pending(task, id, KEYS[1], KEYS[2], KEYS[3], KEYS[5], now)
    changed[#changed + 1] = id
    expired = expired + 1
  end
end

while steps_left > 0 do
  if expired >= max_expired then return done(1) end
  steps_left = steps_left - 1
  local head = redis.call('ZRANGEBYSCORE', KEYS[1], from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if #head == 0 then return done(0) end
  local id, score = head[1], tonumber(head[2])
  local task = ARGV[1] .. id
  local f = redis.call('HMGET', task, 'status', 'pexp', 'dl')
  local again = f[2] and f[3] == '2'  -- retried by an operator, not started since
  if again then retried = retried + 1 end
  if not f[1] or not f[2] or (again and retried <= RETRIED_PER_BAND) then
    -- No pending deadline: started once and handed back. Or no hash here: gone past its
    -- pending TTL (a claim drops the id), or not moved here yet by a reshard: not dropped.
    -- Or retried by an operator: back at its old place with a later deadline than the tasks
    -- behind it, which the deadline set watches (requeue-7.lua).
    from = '(' .. int(score)
  elseif tonumber(f[2]) <= now then
    expire_pending(task, id, KEYS[1], KEYS[2], KEYS[3], KEYS[5], now)
    expired = expired + 1
    changed[expired] = id
  else
    -- Not due: neither is anything after it in this band (or too many retried tasks lead it).
    -- Jump to the next lower priority.
    if score > 0 then return done(0) end  -- priority 0 is the last band
    local priority = math.ceil(-score / BAND)
    from = int(-(priority - 1) * BAND)  -- where that band starts (oldest-1.lua)
    retried = 0
  end
end
return done(1)
