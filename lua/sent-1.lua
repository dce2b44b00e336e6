--[[ Move sliding-window entries to when their calls really left the dispatcher.
The claim records an admission at the Redis time it ran; the call may leave later (a process
busy for a moment, a connection to open), and a window that is exact at admission is then
over the limit where the upstream receives the calls. Each entry moves later by its measured
delay, so the windows later admissions are checked against are those of the real sends.
KEYS[1] a sliding-window log (a ZSet; its members are the claims' lease tokens, with
':<units>' in a per-cost log)
ARGV[1], ARGV[2], ...  member, delay (ms), member, delay, ...
Entries already gone (out of the window) stay gone (XX). Returns how many moved.
]]

local moved, longest = 0, 0
for i = 1, #ARGV, 2 do
  local delay = tonumber(ARGV[i + 1])
  if redis.call('ZADD', KEYS[1], 'XX', 'INCR', delay, ARGV[i]) then
    moved = moved + 1
    if delay > longest then longest = delay end
  end
end
-- A moved entry must outlive the key's expiry, which the last admission set.
local ttl = redis.call('PTTL', KEYS[1])
if moved > 0 and ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl + longest) end
return moved
