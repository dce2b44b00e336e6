--[[ Cancel pending tasks of one endpoint (an operator's purge), at most ARGV[2] per run: the
caller runs it again while it reports more. Each task ends as a user's cancel ends it
(cancel-9.lua): `cancelled`, out of its queue, into the outbox, counted, announced.
Tasks waiting out a retry back-off are pending too: they go after the queue.
KEYS[1] queue    KEYS[2] retry (ZSet)    KEYS[3] stats    KEYS[4] outbox
KEYS[5] hooks (lifecycle.lua)
ARGV[1] task key prefix    ARGV[2] max tasks this run
Returns {cancelled, 1 if it stopped at the bound (more may be left) else 0}. A queued id whose
hash says anything but pending stays where it is: not this script's to judge.
Task hashes of ids read here are built from ARGV[1] (prefix), same hash tag.
]]
--@include now.lua
--@include lifecycle.lua
--@include stats.lua
--@include events.lua

local max = tonumber(ARGV[2])
local now = now_ms()
local changed, taken = {}, 0
for _, set in ipairs({KEYS[1], KEYS[2]}) do
  if taken >= max then break end
  local ids = redis.call('ZRANGE', set, 0, max - taken - 1)
  taken = taken + #ids
  for _, id in ipairs(ids) do
    local task = ARGV[1] .. id
    local status = redis.call('HGET', task, 'status')
    if status == 'pending' then
      redis.call('ZREM', set, id)
      to_outbox(KEYS[4], KEYS[5], task, id, now, 'status', 'cancelled')
      changed[#changed + 1] = id
    elseif not status then
      redis.call('ZREM', set, id)  -- its hash is gone: nothing left to run
    end
  end
end
if #changed > 0 then redis.call('HINCRBY', KEYS[3], 'cancelled', #changed) end
publish_changed(KEYS[1], changed)
return {#changed, taken >= max and 1 or 0}
