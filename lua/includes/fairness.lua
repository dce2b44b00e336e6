-- Fair turns inside a priority band (endpoint `fairness: "per_user"`). Include now.lua (int)
-- first.
--
-- The queue stays one ZSet, so claim, cancel, expiry, status (ZRANK) and every hand-back
-- (release, reap, retry: they put a task back with its stored `score`) work unchanged. Only
-- the score of a new task differs: inside its band (score = band + offset, 0 <= offset < 2^43)
-- offset = turn * 2^13 + (arrival seq mod 2^13). A user's n-th pending task of the band takes
-- the n-th turn from the band's current one (the turn of the band's head), so users with
-- tasks pending in a band take turns, and a newcomer's task lands in the current round.
-- Bounds: turn < 2^30, so offset < 2^43 and a band never reaches the next one (the score
-- stays below 2^53 as in fifo). Turns count from 0 again whenever a task arrives in a band
-- with nothing pending; only a band that never drains in ~10^9 claims reaches the cap, and
-- past it new tasks share the last turn (in arrival order mod 2^13) instead of overflowing.
-- Inside one turn (at most one task per user) the order is arrival mod 2^13.
-- State: `<prefix>:{e}:turns:<priority>` (Keys.turns, passed by the submitter, who knows the
-- priority), a hash user id -> the last turn given to that user, dropped when the band drains
-- and expiring a pending TTL after the band's last submit.

local FAIR_TURN, FAIR_MAX_TURN = 8192, 1073741823  -- 2^13, 2^30 - 1

-- The offset inside its band of a new task of `user` (band score `band`, the band's turns hash
-- `turns`), updating that user's last turn.
local function fair_offset(queue, turns, band, user, seq, pending_ttl)
  local lo, hi = int(band), '(' .. int(band + 8796093022208)
  local head = redis.call('ZRANGEBYSCORE', queue, lo, hi, 'WITHSCORES', 'LIMIT', 0, 1)
  local turn = 0
  if #head == 0 then
    redis.call('DEL', turns)  -- nothing pending in the band: the turns start over
  else
    local current = math.floor((tonumber(head[2]) - band) / FAIR_TURN)
    local tail = redis.call('ZREVRANGEBYSCORE', queue, hi, lo, 'WITHSCORES', 'LIMIT', 0, 1)
    local last = tonumber(redis.call('HGET', turns, user) or '-1')
    -- Never past the band's last turn + 1: a user whose tasks were cancelled or purged
    -- keeps a stale last turn, which must not send its next task behind rounds that no
    -- longer exist (while others' new tasks keep taking the turns before it).
    last = math.min(last, math.floor((tonumber(tail[2]) - band) / FAIR_TURN))
    turn = math.min(math.max(current, last + 1), FAIR_MAX_TURN)
  end
  redis.call('HSET', turns, user, turn)
  if redis.call('PTTL', turns) < pending_ttl then redis.call('PEXPIRE', turns, pending_ttl) end
  return turn * FAIR_TURN + seq % FAIR_TURN
end
