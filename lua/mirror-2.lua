--[[ Put a registry mirror right (app/core/registry.py, reconcile), unless an admin write came
since it was read: a compare-and-set on the mirror's version, the WATCH of a transaction
without one (redis-py runs a Cluster transaction's reads after WATCH in a thread with an event
loop of its own, blocking ours and mixing loops).
KEYS[1] the mirror's hash    KEYS[2] its version
ARGV[1] the version the reconcile read ('' if none)    ARGV[2] how many fields go
ARGV[3..] the fields that go, then field, value pairs to set
Returns 1 if applied, 0 if the version moved meanwhile (the admin write wins).
]]

if (redis.call('GET', KEYS[2]) or '') ~= ARGV[1] then return 0 end
local gone = tonumber(ARGV[2])
if gone > 0 then redis.call('HDEL', KEYS[1], unpack(ARGV, 3, 2 + gone)) end
if #ARGV > 2 + gone then redis.call('HSET', KEYS[1], unpack(ARGV, 3 + gone, #ARGV)) end
redis.call('INCR', KEYS[2])
return 1
