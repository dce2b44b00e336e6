-- Status changes for waiters (app/queue/events.py): every script that changes a task's status
-- publishes the ids it changed, once per run, on its endpoint's channel `<prefix>:{e}:ev`
-- (named from any key of the endpoint: same hash tag, so a Cluster port can use SPUBLISH).
-- A channel, not a key: the only name a script builds from a key it was given (keys come in
-- KEYS, tests/test_scale_out.py).

local function event_channel(any_key, kind)
  return (string.gsub(any_key, '}:[^}]*$', '}:' .. (kind or 'ev')))
end

-- A running offline call cancelled: the dispatcher holding its lease hears its id on the
-- endpoint's cancel channel `<prefix>:{e}:cx` (app/queue/cancels.py) and aborts the call.
local function publish_cancel(any_key, id)
  redis.call('PUBLISH', event_channel(any_key, 'cx'), id)
end

local function publish_changed(any_key, ids)
  if #ids > 0 then
    redis.call('PUBLISH', event_channel(any_key), table.concat(ids, ' '))
  end
end
