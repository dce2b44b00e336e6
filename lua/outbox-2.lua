--[[ What the outbox writer moves to SQL next, without the results themselves: ids and result
sizes, so that it fetches the results in replies of bounded size (one HSCAN of the old outbox
asked for every record at once: 400 x 2 MB in a reply nobody could read within the socket
timeout, while it kept Redis busy for every other caller).
KEYS[1] outbox: ZSet of finished task ids whose row SQL does not have yet, oldest first
KEYS[2] legacy outbox: Hash id -> JSON record, written by versions before the ZSet
ARGV[1] task key prefix    ARGV[2] max ids
Returns {source, id, size, id, size, ...}: source 'legacy' (sizes of the JSON records) while
the legacy hash holds any, then 'tasks' (sizes of the task hashes' results; -1 for a task
whose hash is gone).
Task hashes of ids read here are built from ARGV[1] (prefix), same hash tag.
]]
local n = tonumber(ARGV[2])
local out = {'tasks'}
if redis.call('EXISTS', KEYS[2]) == 1 then
  out[1] = 'legacy'
  for _, id in ipairs(redis.call('HRANDFIELD', KEYS[2], n)) do
    out[#out + 1] = id
    out[#out + 1] = redis.call('HSTRLEN', KEYS[2], id)
  end
  return out
end
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, n - 1)) do
  local task = ARGV[1] .. id
  local size = -1
  if redis.call('EXISTS', task) == 1 then size = redis.call('HSTRLEN', task, 'result') end
  out[#out + 1] = id
  out[#out + 1] = size
end
return out
