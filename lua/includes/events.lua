-- Status changes for waiters (app/queue/events.py): every script that changes a task's status
-- publishes the ids it changed, once per run, on its endpoint's channel `<prefix>:{e}:ev`
-- (named from any key of the endpoint: same hash tag, so a Cluster port can use SPUBLISH).
-- A channel, not a key: the only name a script builds from a key it was given (keys come in
-- KEYS, tests/test_scale_out.py).

local function event_channel(any_key)
  return (string.gsub(any_key, '}:[^}]*$', '}:ev'))
end

local function publish_changed(any_key, ids)
  if #ids > 0 then
    redis.call('PUBLISH', event_channel(any_key), table.concat(ids, ' '))
  end
end
