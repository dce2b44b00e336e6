"""Every Redis key the gateway uses, in one place.

Each endpoint's keys carry the endpoint id as a hash tag (`{e}`), so the scripts that touch
one endpoint touch one Cluster slot.  A task id names its endpoint after a dot
(`<uuid7 hex>.<endpoint id>`), so status and cancel find the task key without a lookup.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "qgw"

    def queue(self, endpoint: str) -> str:
        """ZSet of pending task ids; score orders by priority, then arrival."""
        return f"{self.prefix}:{{{endpoint}}}:q"

    def active(self, endpoint: str) -> str:
        """ZSet of claimed task ids; score is the lease deadline (ms, Redis clock)."""
        return f"{self.prefix}:{{{endpoint}}}:active"

    def ratelimit(self, endpoint: str, limiter: str) -> str:
        """Limiter state; one key per kind, so switching kinds never meets a stale type.
        The scripts keep the pacing state beside it, `<this key>:pace:<rate>/<interval>`."""
        return f"{self.prefix}:{{{endpoint}}}:rl:{limiter}"

    def task_prefix(self, endpoint: str) -> str:
        return f"{self.prefix}:{{{endpoint}}}:t:"

    def retry(self, endpoint: str) -> str:
        """ZSet of started tasks waiting out a retry back-off; score = when due (ms, Redis
        clock).  claim-5.lua finds it as the sibling `<prefix>:{e}:retry` of the queue."""
        return f"{self.prefix}:{{{endpoint}}}:retry"

    def seq(self, endpoint: str) -> str:
        """Per-endpoint arrival counter: breaks ties inside a priority exactly."""
        return f"{self.prefix}:{{{endpoint}}}:seq"

    def turns(self, endpoint: str, priority: int) -> str:
        """Hash user id -> the last turn given to that user in one priority band of a
        `fairness: per_user` endpoint (lua/includes/fairness.lua finds it as the sibling
        `<prefix>:{e}:turns:<priority>` of the queue)."""
        return f"{self.prefix}:{{{endpoint}}}:turns:{priority}"

    def stats(self, endpoint: str) -> str:
        """Hash of counters and the moving average of exec time; also `upause`, until when
        (ms) the endpoint's upstream asked for a pause (lua/includes/upstream.lua)."""
        return f"{self.prefix}:{{{endpoint}}}:stats"

    def outbox(self, endpoint: str) -> str:
        """ZSet of finished task ids whose SQL row is not written yet; score = when each ended
        (app/lifecycle/outbox.py). Their task hashes have no TTL until it is.

        Scripts whose KEYS their callers fix find it as a sibling of a key they were given
        (sibling_key, lua/includes/stats.lua), so it must stay `<prefix>:{e}:tosql`."""
        return f"{self.prefix}:{{{endpoint}}}:tosql"

    def hooks(self, endpoint: str) -> str:
        """ZSet of finished task ids whose webhook is not delivered yet; score = when due, or
        the lease deadline of the sender trying it (app/queue/webhooks.py). lifecycle.lua
        finds it as the sibling `<prefix>:{e}:hooks` of the outbox."""
        return f"{self.prefix}:{{{endpoint}}}:hooks"

    def outbox_legacy(self, endpoint: str) -> str:
        """Hash task id -> JSON copy of a finished task, the outbox of earlier versions: the
        writer drains what an upgrade finds there."""
        return f"{self.prefix}:{{{endpoint}}}:outbox"

    def outbox_refused(self, endpoint: str) -> str:
        """Hash task id -> outbox record the database refused even without its result; kept
        for an operator (the writer logs each one), never retried."""
        return f"{self.prefix}:{{{endpoint}}}:outbox:refused"

    def delivered(self, endpoint: str) -> str:
        """ZSet of finished task ids their owner has read; score = when the SQL row may go."""
        return f"{self.prefix}:{{{endpoint}}}:delivered"

    def events(self, endpoint: str) -> str:
        """Pub/sub channel of the endpoint's status changes (lua/includes/events.lua): the ids
        a script changed. Hash-tagged like a key, so a Cluster port can use sharded pub/sub."""
        return f"{self.prefix}:{{{endpoint}}}:ev"

    def history(self, endpoint: str) -> str:
        """List of the endpoint's samples every 10 s, newest first, capped at an hour
        (app/lifecycle/history.py); deleted with the endpoint, like its stats."""
        return f"{self.prefix}:{{{endpoint}}}:hist"

    def task(self, task_id: str) -> str:
        return self.task_prefix(endpoint_of(task_id)) + task_id

    def idempotency(self, user_id: int, key: str) -> str:
        return f"{self.prefix}:idem:{user_id}:{key}"

    def quota(self, user_id: int) -> str:
        """Tasks the user submitted today; expires at the end of the day on the Redis clock
        (lua/submit-7.lua), so no day in the name: an API host's clock never picks the day."""
        return f"{self.prefix}:quota:{user_id}"

    @property
    def wake(self) -> str:
        """ZSet of endpoints worth a claim attempt; score = when (ms, Redis clock)."""
        return f"{self.prefix}:wake"

    @property
    def delayed(self) -> str:
        """ZSet of rate-limited endpoints; score = when their limiter admits again."""
        return f"{self.prefix}:delayed"

    @property
    def dispatchers(self) -> str:
        """Hash dispatcher ident -> JSON heartbeat (in flight, capacity, when), each written
        every second by its process (app/queue/heartbeats.py); stale ones are pruned."""
        return f"{self.prefix}:dispatchers"

    @property
    def endpoints(self) -> str:
        return f"{self.prefix}:endpoints"

    @property
    def api_keys(self) -> str:
        return f"{self.prefix}:apikeys"

    def lock(self, job: str) -> str:
        """A lock with a TTL that one replica holds while it runs a periodic job."""
        return f"{self.prefix}:lock:{job}"

    def version(self, table: str) -> str:
        return f"{self.prefix}:{table}:ver"

    def channel(self, table: str) -> str:
        return f"{self.prefix}:{table}:changed"

    @property
    def ready_probe(self) -> str:
        """A short-lived key /readyz writes: a server that went read-only (a replica) fails."""
        return f"{self.prefix}:readyz"


def endpoint_of(task_id: str) -> str:
    return task_id.partition(".")[2]
