-- Pauses an upstream asked for (app/queue/signals.py). Field `upause` of the endpoint's stats
-- hash holds until when (ms, Redis clock) it admits nothing, on every dispatcher (a field, so a
-- scrape reads it with the counters); once that has passed, one
-- probe call goes first (`<prefix>:{e}:probe` holds its lease token and expires with its lease),
-- and only its success lifts the pause. Both keys are siblings of any key of the endpoint.
-- Include stats.lua (sibling_key) first.

local function upstream_pause(any_key, now, ms)
  local stats = sibling_key(any_key, 'stats')
  local untl = now + ms
  local current = tonumber(redis.call('HGET', stats, 'upause'))
  if not current or untl > current then redis.call('HSET', stats, 'upause', untl) end
  redis.call('DEL', sibling_key(any_key, 'probe'))
end

-- A call ended with no pause asked for: if it was the probe, a success reopens the endpoint,
-- and a failure lets the next claim send another probe.
local function upstream_call_ended(any_key, token, ok)
  local probe = sibling_key(any_key, 'probe')
  if redis.call('GET', probe) == token then
    redis.call('DEL', probe)
    if ok then redis.call('HDEL', sibling_key(any_key, 'stats'), 'upause') end
  end
end
