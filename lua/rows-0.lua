--[[ The fields of finished tasks for their SQL rows, all in one reply: the outbox writer's
fetch of a group (app/lifecycle/outbox.py), one command instead of an HMGET per task.
KEYS[1..] the tasks' hashes    ARGV[1..] the fields, in row order
Returns, per task in KEYS order, its fields' values (all nil when its hash is gone).
]]
local rows = {}
for i = 1, #KEYS do
  rows[i] = redis.call('HMGET', KEYS[i], unpack(ARGV))
end
return rows
