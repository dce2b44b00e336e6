-- Status changes for waiters (app/queue/events.py): every script that changes a task's status
-- publishes the ids it changed, once per run, on its endpoint's channel `<prefix>:{e}:ev`
-- (a sibling of any key of the endpoint: same hash tag, so a Cluster port can use SPUBLISH).
-- Include stats.lua first (sibling_key).

local function publish_changed(any_key, ids)
  if #ids > 0 then
    redis.call('PUBLISH', sibling_key(any_key, 'ev'), table.concat(ids, ' '))
  end
end
