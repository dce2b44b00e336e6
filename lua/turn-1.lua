--[[ A proxied request's turn in line (app/proxy/relay.py): its task's status and lease token,
and how long ago its claim admitted it, on the clock the claim used. The API process makes
the call itself, a moment after the claim (the status event, this read, a connection to
open): the sliding-window entries its admission made move later by that much once the call
has left (sent-1.lua), as a dispatcher's do.
KEYS[1] task
Returns {status or false, lease or false, ms since its admission (0 when not started),
cost (what its admission spent of per-cost limits) or false, the lease its claim gave (ms;
0 when not started): a pickup lease, app/queue/owners.py}.
]]
--@include now.lua

local f = redis.call('HMGET', KEYS[1], 'status', 'lease', 'started_at', 'cost', 'deadline')
local age, granted = 0, 0
if f[3] then
  age = math.max(0, now_ms() - tonumber(f[3]))
  if f[5] then granted = tonumber(f[5]) - tonumber(f[3]) end
end
return {f[1] or false, f[2] or false, age, f[4] or false, granted}
