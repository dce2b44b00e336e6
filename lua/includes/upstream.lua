-- Pauses an upstream asked for (app/queue/signals.py). Field `upause` of the endpoint's stats
-- hash holds until when (ms, Redis clock) it admits nothing, on every dispatcher (a field, so a
-- scrape reads it with the counters); once that has passed, one
-- probe call goes first (`<prefix>:{e}:probe` holds its lease token and expires with its lease),
-- and only its success lifts the pause. The caller passes both keys (stats, probe) in KEYS.

local function upstream_pause(stats, probe, now, ms)
  local untl = now + ms
  local current = tonumber(redis.call('HGET', stats, 'upause'))
  if not current or untl > current then redis.call('HSET', stats, 'upause', untl) end
  redis.call('DEL', probe)
end

-- A call ended with no pause asked for: if it was the probe, a success reopens the endpoint,
-- and a failure lets the next claim send another probe.
local function upstream_call_ended(stats, probe, token, ok)
  if redis.call('GET', probe) == token then
    redis.call('DEL', probe)
    if ok then redis.call('HDEL', stats, 'upause') end
  end
end
