--[[ The janitor's purge reaches Redis (app/lifecycle/janitor.py): tasks whose SQL rows it is
about to delete leave Redis too when they have ended, so that no hash outlives its row and
names a result object deleted with it (a retention shorter than the done TTL, or than a wait
in line plus the done TTL). A task running again (an operator's retry of a dead letter) keeps
its hash, as does one waiting in the outbox to be written anew.
KEYS[1] outbox (ZSet) of the tasks' endpoint    KEYS[2..] the tasks' hashes, one per id of ARGV
ARGV[1..] task ids
Returns how many hashes went.
]]
local ended = {completed = true, failed = true, expired = true, cancelled = true}
local gone = 0
for i = 1, #ARGV do
  local task = KEYS[i + 1]
  local status = redis.call('HGET', task, 'status')
  if status and ended[status] and not redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    gone = gone + redis.call('DEL', task)
  end
end
return gone
