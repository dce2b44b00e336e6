"""Every Redis key the gateway uses, in one place.

Each endpoint's keys share one hash tag, so the scripts that touch one endpoint touch one
Cluster slot.  A task id names its endpoint after a dot (`<uuid7 hex>.<endpoint id>`), so
status and cancel find the task key without a lookup.

On one Redis (or Sentinel) the tag is the endpoint id, `qgw:{e}:q`, and the wake markers are
one global set.  On a Cluster a script may not reach a global set, so endpoints are grouped
in SHARDS groups: an endpoint's keys carry its group's tag, `qgw:<endpoint>:{g7.12}:q`, and
each group has its own wake and delayed sets in the same slot, which a dispatcher blocks on, one
connection per group.  The group tags are picked to lie evenly over the slot space, so the
groups spread evenly over masters whatever the slot ranges; a user's quota and idempotency
keys carry the user's tag, and the registry's keys one tag of their own, so its
transactions stay in one slot.  Every key a script touches that its caller can name comes in
its KEYS (`of` builds an endpoint's list once); only the task hashes of ids a script reads
itself are built there, from the task key prefix (same tag), and the events channel from any
key of the endpoint: both layouts keep the tag right before the key's last part.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from functools import cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

SHARDS = 16  # endpoint groups on a Cluster: wake loops per dispatcher, slots endpoints use


@cache
def group_tags() -> tuple[str, ...]:
    """One tag per group, the first `g<i>.<n>` whose slot is in the group's share of slots."""
    width = REDIS_CLUSTER_HASH_SLOTS // SHARDS
    tags = []
    for i in range(SHARDS):
        n = 0
        while key_slot(f"g{i}.{n}".encode()) // width != i:
            n += 1
        tags.append(f"g{i}.{n}")
    return tuple(tags)


def group_of(endpoint: str) -> int:
    return zlib.crc32(endpoint.encode()) % SHARDS


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "qgw"
    cluster: bool = False
    _tags: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    _lists: dict[tuple[str, ...], tuple[str, ...]] = field(
        default_factory=dict, compare=False, repr=False)

    def tag(self, endpoint: str) -> str:
        """`{e}`, or on a Cluster `e:{<group tag>}`: the part every key of the endpoint has."""
        tag = self._tags.get(endpoint)
        if tag is None:
            tag = (f"{endpoint}:{{{group_tags()[group_of(endpoint)]}}}" if self.cluster
                   else f"{{{endpoint}}}")
            self._tags[endpoint] = tag
        return tag

    def of(self, endpoint: str, *names: str) -> tuple[str, ...]:
        """The keys `names` (methods here taking only the endpoint id) of one endpoint, in that
        order: a script's KEYS, built once per endpoint instead of on every call."""
        found = self._lists.get((endpoint, *names))
        if found is None:
            found = tuple(getattr(self, n)(endpoint) for n in names)
            self._lists[(endpoint, *names)] = found
        return found

    def queue(self, endpoint: str) -> str:
        """ZSet of pending task ids; score orders by priority, then arrival."""
        return f"{self.prefix}:{self.tag(endpoint)}:q"

    def active(self, endpoint: str) -> str:
        """ZSet of claimed task ids; score is the lease deadline (ms, Redis clock)."""
        return f"{self.prefix}:{self.tag(endpoint)}:active"

    def ratelimit(self, endpoint: str, limiter: str) -> str:
        """Limiter state; one key per kind, so switching kinds never meets a stale type.
        The window limiters keep their pacing state beside it (`pace`)."""
        return f"{self.prefix}:{self.tag(endpoint)}:rl:{limiter}"

    def pace(self, endpoint: str, limiter: str, rate: int, interval_ms: int) -> str:
        """A window limiter's pacing state (lua/includes/ratelimit.lua), named by the rate it
        paces, so a changed limit paces afresh at once."""
        return f"{self.ratelimit(endpoint, limiter)}:pace:{rate}/{interval_ms}"

    def further_limit(self, endpoint: str, kind: str, per: str, rate: int, interval_ms: int
                      ) -> str:
        """A further limit's state (docs/api.md `limits`), named by what it limits (claim-12.lua
        and ack-7.lua take one per limit after their fixed KEYS)."""
        return f"{self.prefix}:{self.tag(endpoint)}:rlx:{kind}:{per}:{rate}/{interval_ms}"

    def further_pace(self, endpoint: str, kind: str, per: str, rate: int, interval_ms: int
                     ) -> str:
        """The pacing state of a further limit that paces (a per-cost sliding window up to a
        minute, lua/includes/limits.lua), beside its state as `pace` is beside the main one."""
        return (f"{self.further_limit(endpoint, kind, per, rate, interval_ms)}"
                f":pace:{rate}/{interval_ms}")

    def task_prefix(self, endpoint: str) -> str:
        return f"{self.prefix}:{self.tag(endpoint)}:t:"

    def retry(self, endpoint: str) -> str:
        """ZSet of started tasks waiting out a retry back-off; score = when due (ms, Redis
        clock)."""
        return f"{self.prefix}:{self.tag(endpoint)}:retry"

    def deadlines(self, endpoint: str) -> str:
        """ZSet of pending task ids whose deadline may come before that of tasks ahead of them
        (a caller's max_wait_s; every task of a per_user endpoint), or after that of tasks
        behind them (an operator's retry, at its old place); score = the deadline (ms)."""
        return f"{self.prefix}:{self.tag(endpoint)}:deadlines"

    def owner(self, endpoint: str, instance: str) -> str:
        """String whose presence says API process `instance` still holds callers of proxied
        requests of the endpoint (app/queue/owners.py); it lapses when the process dies."""
        return f"{self.prefix}:{self.tag(endpoint)}:owner.{instance}"

    def probe(self, endpoint: str) -> str:
        """The lease token of the one probe call a paused endpoint lets through
        (lua/includes/upstream.lua); expires with its lease."""
        return f"{self.prefix}:{self.tag(endpoint)}:probe"

    def seq(self, endpoint: str) -> str:
        """Per-endpoint arrival counter: breaks ties inside a priority exactly."""
        return f"{self.prefix}:{self.tag(endpoint)}:seq"

    def arrivals(self, endpoint: str) -> str:
        """ZSet of the pending task ids of an endpoint with `max_starvation_s`, by arrival (ms):
        the claim serves one waiting past the bound first (lua/includes/starvation.lua)."""
        return f"{self.prefix}:{self.tag(endpoint)}:arrivals"

    def real_costs(self, endpoint: str) -> str:
        """Hash user id -> "<moving average>,<last update ms>" of what that caller's calls
        really cost on a `cost_from` endpoint with further limits; idle callers are pruned
        (lua/includes/costs.lua)."""
        return f"{self.prefix}:{self.tag(endpoint)}:rc"

    def turns(self, endpoint: str, priority: int) -> str:
        """Hash user id -> the last turn given to that user in one priority band of a
        `fairness: per_user` endpoint (lua/includes/fairness.lua; submit-11.lua's KEYS[11])."""
        return f"{self.prefix}:{self.tag(endpoint)}:turns:{priority}"

    def stats(self, endpoint: str) -> str:
        """Hash of counters and the moving average of exec time; also `upause`, until when
        (ms) the endpoint's upstream asked for a pause (lua/includes/upstream.lua)."""
        return f"{self.prefix}:{self.tag(endpoint)}:stats"

    def outbox(self, endpoint: str) -> str:
        """ZSet of finished task ids whose SQL row is not written yet; score = when each ended
        (app/lifecycle/outbox.py). Their task hashes have no TTL until it is."""
        return f"{self.prefix}:{self.tag(endpoint)}:tosql"

    def hooks(self, endpoint: str) -> str:
        """ZSet of finished task ids whose webhook is not delivered yet; score = when due, or
        the lease deadline of the sender trying it (app/queue/webhooks.py); every script that
        ends a task takes it in KEYS (lua/includes/lifecycle.lua)."""
        return f"{self.prefix}:{self.tag(endpoint)}:hooks"

    def outbox_legacy(self, endpoint: str) -> str:
        """Hash task id -> JSON copy of a finished task, the outbox of earlier versions: the
        writer drains what an upgrade finds there."""
        return f"{self.prefix}:{self.tag(endpoint)}:outbox"

    def outbox_refused(self, endpoint: str) -> str:
        """Hash task id -> outbox record the database refused even without its result; kept
        for an operator (the writer logs each one), never retried."""
        return f"{self.prefix}:{self.tag(endpoint)}:outbox:refused"

    def delivered(self, endpoint: str) -> str:
        """ZSet of finished task ids their owner has read; score = when the SQL row may go."""
        return f"{self.prefix}:{self.tag(endpoint)}:delivered"

    def events(self, endpoint: str) -> str:
        """Pub/sub channel of the endpoint's status changes (lua/includes/events.lua): the ids
        a script changed. Hash-tagged like a key, so a Cluster port can use sharded pub/sub."""
        return f"{self.prefix}:{self.tag(endpoint)}:ev"

    def cancels(self, endpoint: str) -> str:
        """Pub/sub channel of the endpoint's running offline calls cancelled (cancel-9.lua):
        the dispatcher holding one aborts it (app/queue/cancels.py)."""
        return f"{self.prefix}:{self.tag(endpoint)}:cx"

    @property
    def cancels_pattern(self) -> str:
        """Every endpoint's `cancels` channel: both layouts end the tag with `}` before it."""
        return f"{self.prefix}:*}}:cx"

    def history(self, endpoint: str) -> str:
        """List of the endpoint's samples every 10 s, newest first, capped at an hour
        (app/lifecycle/history.py); deleted with the endpoint, like its stats."""
        return f"{self.prefix}:{self.tag(endpoint)}:hist"

    def task(self, task_id: str) -> str:
        return self.task_prefix(endpoint_of(task_id)) + task_id

    def idempotency(self, user_id: int, key: str) -> str:
        if self.cluster:
            return f"{self.prefix}:{{u{user_id}}}:idem:{key}"
        return f"{self.prefix}:idem:{user_id}:{key}"

    def quota(self, user_id: int) -> str:
        """Tasks the user submitted today; expires at the end of the day on the Redis clock
        (lua/submit-11.lua), so no day in the name: an API host's clock never picks the day."""
        if self.cluster:
            return f"{self.prefix}:{{u{user_id}}}:quota"
        return f"{self.prefix}:quota:{user_id}"

    def wake(self, endpoint: str) -> str:
        """ZSet of endpoints worth a claim attempt; score = when (ms, Redis clock). One for
        all on one Redis, one per group on a Cluster."""
        if self.cluster:
            return f"{self.prefix}:{{{group_tags()[group_of(endpoint)]}}}:wake"
        return f"{self.prefix}:wake"

    def delayed(self, endpoint: str) -> str:
        """ZSet of rate-limited endpoints; score = when their limiter admits again."""
        if self.cluster:
            return f"{self.prefix}:{{{group_tags()[group_of(endpoint)]}}}:delayed"
        return f"{self.prefix}:delayed"

    def wake_sets(self) -> list[tuple[str, str]]:
        """Every (wake, delayed) pair: what a dispatcher blocks on and the reaper promotes."""
        if self.cluster:
            return [(f"{self.prefix}:{{{t}}}:wake", f"{self.prefix}:{{{t}}}:delayed")
                    for t in group_tags()]
        return [(f"{self.prefix}:wake", f"{self.prefix}:delayed")]

    def live(self, endpoint: str) -> str:
        """Hash whose field `endpoint` says it exists, read by the scripts that enqueue
        (submit-11.lua, requeue-7.lua): the registry hash on one Redis; on a Cluster, a hash in
        the endpoint's slot that the registry keeps beside its own (core/registry.py)."""
        if self.cluster:
            return f"{self.prefix}:{self.tag(endpoint)}:live"
        return self.endpoints

    @property
    def dispatchers(self) -> str:
        """Hash dispatcher ident -> JSON heartbeat (in flight, capacity, when), each written
        every second by its process (app/queue/heartbeats.py); stale ones are pruned."""
        return f"{self.prefix}:dispatchers"

    @property
    def _registry(self) -> str:
        """The registry's keys share a tag on a Cluster (its transactions span them)."""
        return f"{self.prefix}:{{registry}}" if self.cluster else self.prefix

    @property
    def endpoints(self) -> str:
        return f"{self._registry}:endpoints"

    @property
    def api_keys(self) -> str:
        return f"{self._registry}:apikeys"

    @property
    def tiers(self) -> str:
        """The tier table's mirror (tier -> its weight, app/tiers.py)."""
        return f"{self._registry}:tiers"

    def withdrawn(self, table: str) -> str:
        """Prefix of the markers of rows withdrawn ahead of their SQL delete."""
        return f"{self._registry}:lock:withdrawn:{table}:"

    def lock(self, job: str) -> str:
        """A lock with a TTL that one replica holds while it runs a periodic job."""
        return f"{self.prefix}:lock:{job}"

    def version(self, table: str) -> str:
        return f"{self._registry}:{table}:ver"

    def channel(self, table: str) -> str:
        return f"{self._registry}:{table}:changed"

    def ready_probe(self, process: str) -> str:
        """A short-lived key /readyz writes: a server that went read-only (a replica) fails.
        On a Cluster each process writes its own, in the group its id picks, so the failover
        of one master makes only the processes probing it unready, not every one at once."""
        if self.cluster:
            return f"{self.prefix}:{{{group_tags()[group_of(process)]}}}:readyz:{process}"
        return f"{self.prefix}:readyz"


#: A task id: 32 hex digits, a dot, its endpoint's id (app/models.py ENDPOINT_ID).
TASK_ID = re.compile(r"^[0-9a-f]{32}\.[a-z0-9][a-z0-9_-]{0,63}$")


def endpoint_of(task_id: str) -> str:
    return task_id.partition(".")[2]
