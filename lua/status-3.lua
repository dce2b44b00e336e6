--[[ A task as its owner sees it, with its place in line; a finished task read by its owner
keeps only a short TTL (it has been delivered).
KEYS[1] task    KEYS[2] queue    KEYS[3] stats of the endpoint
ARGV[1] task id    ARGV[2] user id    ARGV[3] read TTL (ms)
Returns {rank or false, measured exec ms or false, field, value, ...}, or {} when missing or not this user's.
]]

local fields = redis.call('HGETALL', KEYS[1])
local owner
for i = 1, #fields, 2 do
  if fields[i] == 'user_id' then owner = fields[i + 1] end
end
if owner ~= ARGV[2] then return {} end
local rank = redis.call('ZRANK', KEYS[2], ARGV[1])
if not rank then
  local status = redis.call('HGET', KEYS[1], 'status')
  if status ~= 'pending' and status ~= 'processing' then
    local ttl = tonumber(ARGV[3])
    if redis.call('PTTL', KEYS[1]) > ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
  end
end
table.insert(fields, 1, redis.call('HGET', KEYS[3], 'exec_ms') or false)
table.insert(fields, 1, rank)
return fields
