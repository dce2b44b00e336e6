--[[ A task as its owner sees it, with its place in line. A finished task read by its owner
has been delivered: it keeps only a short TTL, it leaves the outbox (no need to write a row
now), and its id is scheduled for deletion from SQL once that TTL has run out; not while its
webhook is due (field `hook`): the webhook sender needs it, and sets its TTL after. A dead
letter (`failed`, `expired`) is never delivered: it stays for operators, in SQL for the
retention, read or not.
KEYS[1] task    KEYS[2] queue    KEYS[3] stats of the endpoint    KEYS[4] outbox (ZSet)
KEYS[5] delivered (ZSet of ids whose SQL row may go, or for a result in the store its object's
key `<id>/<random>`, which goes with the row; score = from when)    KEYS[6] active
ARGV[1] task id    ARGV[2] user id    ARGV[3] read TTL (ms); 0 = a peek that delivers nothing
ARGV[4] read TTL (ms) of a result in the result store (`"enc":"external"` in result_meta):
longer, as it is fetched in pieces after the read (Range, a presigned URL)
ARGV[5] optional: the largest `result` returned (bytes; absent or 0: any); a longer one is left
out of the reply, which then has the field `result_omitted` = its length instead (a large read:
the API serves its encoded answer from its own cache, app/routes/large.py)
Returns {rank or false, measured, field, value, ...}, or {} when missing or not this user's;
measured = {exec ms, slot ms, tasks in flight, last admission, upstream pause until, now, limited
until, average cost, adaptive limit} of the endpoint while the task waits in line, for the wait
estimate (app/queue/tasks.py estimate_wait; in flight from the active set, KEYS[6]); for a task
waiting out a retry's back-off (`retry_at`) only now, sixth; else {}.
]]
--@include now.lua

local limit = tonumber(ARGV[5] or '0') or 0
local fields
local size = limit > 0 and redis.call('HSTRLEN', KEYS[1], 'result') or 0
if size > limit then  -- not copied out of the hash: each read would cost Redis its length
  fields = {}
  for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
    if name ~= 'result' then
      fields[#fields + 1] = name
      fields[#fields + 1] = redis.call('HGET', KEYS[1], name)
    end
  end
  fields[#fields + 1] = 'result_omitted'
  fields[#fields + 1] = tostring(size)
else
  fields = redis.call('HGETALL', KEYS[1])
end
local owner, hook, external, backing_off
for i = 1, #fields, 2 do
  if fields[i] == 'user_id' then owner = fields[i + 1] end
  if fields[i] == 'hook' then hook = true end
  if fields[i] == 'retry_at' then backing_off = true end
  if fields[i] == 'result_meta' and string.find(fields[i + 1], '"enc":"external"', 1, true) then
    local ok, meta = pcall(cjson.decode, fields[i + 1])
    external = ok and type(meta) == 'table' and type(meta.ref) == 'string' and meta.ref or true
  end
end
if owner ~= ARGV[2] then return {} end
local rank = redis.call('ZRANK', KEYS[2], ARGV[1])
if not rank then
  local status = redis.call('HGET', KEYS[1], 'status')
  if (status == 'completed' or status == 'cancelled') and not hook then
    local ttl = tonumber(ARGV[3])
    if ttl > 0 and external then ttl = math.max(ttl, tonumber(ARGV[4])) end
    local left = redis.call('PTTL', KEYS[1])  -- -1: no TTL, still waiting for SQL
    if ttl > 0 then
      if left > ttl or left == -1 then  -- a done TTL already shorter (saved-1.lua) is kept
        redis.call('PEXPIRE', KEYS[1], ttl)
        redis.call('ZREM', KEYS[4], ARGV[1])
      end
      -- The row's deletion is scheduled on every read, whatever TTL the hash has left: a read
      -- after the writer saved the row and set a done TTL shorter than this one must not
      -- leave the row in SQL. NX: reading again does not put it off. Deleting the row only
      -- after the TTL also covers a writer that had already taken the outbox copy and
      -- commits it just after this read.
      -- A result in the store is scheduled by its object's key (`<task id>/<random>`): the
      -- row may never have been written (read before the writer came), and the hash goes at
      -- the same moment, so the key is kept here for the writer to delete the object by.
      local member = type(external) == 'string' and external or ARGV[1]
      redis.call('ZADD', KEYS[5], 'NX', now_ms() + ttl, member)
    end
  end
end
local measured = {}
if rank then
  local m = redis.call('HMGET', KEYS[3], 'exec_ms', 'slot_ms', 'last_admit', 'upause',
    'limited_until', 'cost_avg', 'alimit')
  measured = {m[1], m[2], redis.call('ZCARD', KEYS[6]), m[3], m[4], now_ms(), m[5], m[6], m[7]}
elseif backing_off then  -- its `retry_at` is the Redis clock's: the wait left is counted on it
  measured = {false, false, false, false, false, now_ms()}
end
table.insert(fields, 1, measured)
table.insert(fields, 1, rank)
return fields
