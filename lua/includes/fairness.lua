-- Fair turns inside a priority band (endpoint `fairness: "per_user"` or "weighted"). Include
-- now.lua (int) first.
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
-- Weighted shares (`fairness: "weighted"`): a user of weight w takes w tasks a round, its
-- turns advancing by 1/w a task; the score counts turns in units of 1/FAIR_SCALE (a task's
-- unit is its turn's, rounded down), so the queue stays one ZSet and wait_num its ZRANK. The
-- hash then keeps each user's last turn as a fraction. per_user is the case w = 1, units of 1.
-- State: `<prefix>:{e}:turns:<priority>` (Keys.turns, passed by the submitter, who knows the
-- priority), a hash user id -> the last turn given to that user, dropped when the band drains
-- and expiring a pending TTL after the band's last submit.

local FAIR_TURN, FAIR_MAX_TURN = 8192, 1073741823  -- 2^13, 2^30 - 1
local FAIR_SCALE = 128  -- units of a turn, weighted (app/queue/fairness.py WEIGHT_SCALE)

-- The turn (in turns) of a score of the band, its unit rounded down.
local function fair_turn_of(score, band, scale)
  return math.floor((tonumber(score) - band) / FAIR_TURN) / scale
end

-- The offset inside its band of a new task of `user` (band score `band`, the band's turns hash
-- `turns`), updating that user's last turn. `fair`: the user id, or for weighted shares
-- "<user id>/<weight>".
local function fair_offset(queue, turns, band, fair, seq, pending_ttl)
  local user, w = string.match(fair, '^([^/]+)/(%d+)$')
  local weight, scale = tonumber(w) or 1, w and FAIR_SCALE or 1
  user = user or fair
  local lo, hi = int(band), '(' .. int(band + 8796093022208)
  local head = redis.call('ZRANGEBYSCORE', queue, lo, hi, 'WITHSCORES', 'LIMIT', 0, 1)
  local turn = 0
  if #head == 0 then
    redis.call('DEL', turns)  -- nothing pending in the band: the turns start over
  else
    local current = fair_turn_of(head[2], band, scale)
    local tail = redis.call('ZREVRANGEBYSCORE', queue, hi, lo, 'WITHSCORES', 'LIMIT', 0, 1)
    local last = tonumber(redis.call('HGET', turns, user) or '') or -1 / weight
    -- Never past the band's last turn + 1: a user whose tasks were cancelled or purged
    -- keeps a stale last turn, which must not send its next task behind rounds that no
    -- longer exist (while others' new tasks keep taking the turns before it). Only past its
    -- unit: the tail's turn is rounded down to one, and a user whose own task is the tail
    -- keeps its fraction (rounded down at every submit, a weight of 100 took 128 a round).
    local tail_turn = fair_turn_of(tail[2], band, scale)
    if math.floor(last * scale + 1e-6) > tail_turn * scale then last = tail_turn end
    turn = math.min(math.max(current, last + 1 / weight), FAIR_MAX_TURN / scale)
  end
  redis.call('HSET', turns, user, string.format('%.17g', turn))
  if redis.call('PTTL', turns) < pending_ttl then redis.call('PEXPIRE', turns, pending_ttl) end
  -- A hair over: k/w added up may fall a rounding error short of its unit.
  return math.floor(turn * scale + 1e-6) * FAIR_TURN + seq % FAIR_TURN
end
