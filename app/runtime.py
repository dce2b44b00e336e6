"""What a process holds while it runs: clients, mirrors, the queue, and its dispatcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncEngine

from app import redis_url, secrets
from app.answer_cache import AnswerCache
from app.core.keys import Keys
from app.core.loop import STORE_ERRORS
from app.core.registry import EndpointRegistry, Mirror, cancel_all
from app.core.scripts import Scripts
from app.db import SQL_JOB_TIMEOUT_S, bounded, make_engine, set_request_timeout, settle
from app.embedded import EmbeddedRedis
from app.endpoints import EndpointConfig
from app.healthcheck import beat, heartbeat_path
from app.lifecycle.jobs import LifecycleJobs
from app.lifecycle.results import OutboxWriter, ResultStore
from app.metrics import SharedScrape
from app.queue import heartbeats
from app.queue.dispatcher import Dispatcher
from app.queue.events import TaskEvents
from app.queue.http1 import UpstreamClient
from app.queue.objects import ObjectStore
from app.queue.owners import Owners
from app.queue.tasks import TaskQueue
from app.queue.upstream import upstream_client
from app.queue.webhooks import WebhookSender
from app.ratelimit.sent import SendTimes
from app.sending import ReadSlots
from app.settings import Settings
from app.store import ApiKey, EndpointStore, KeyStore
from app.tiers import Tier, TierStore

log = logging.getLogger(__name__)
#: A delete under way keeps its endpoint out of the registry for this long at most: well past
#: its steps' bounds (a few seconds each), short enough if the deleting process dies.
RETIRE_HOLD_S = 30.0


def process_ident() -> str:
    """This process among all of the deployment's (hosts, or containers by their hostname)."""
    return f"{os.getpid()}@{socket.gethostname()}"


def redis_client(url: str, timeout_s: float | None, max_connections: int = 512) -> Redis:
    """The client for QGW_REDIS_URL: one Redis, or the master a Sentinel names (app/redis_url)."""
    return redis_url.client(url, timeout_s, max_connections)


@dataclass
class Runtime:
    settings: Settings
    with_dispatcher: bool = False
    ident: str = field(default_factory=process_ident)  # picks the /readyz probe's key
    redis_url: str = field(init=False)
    redis: Redis = field(init=False)
    engine: AsyncEngine = field(init=False)
    keys: Keys = field(init=False)
    registry: EndpointRegistry = field(init=False)
    api_keys: Mirror[ApiKey] = field(init=False)
    endpoints: EndpointStore = field(init=False)
    key_store: KeyStore = field(init=False)
    tiers: TierStore = field(init=False)
    queue: TaskQueue = field(init=False)
    events: TaskEvents = field(init=False)  # waiters' status changes (?wait=, the SSE stream)
    send_times: SendTimes = field(init=False)  # proxied calls' sliding-window entries
    owners: Owners = field(init=False)  # this process's proxied requests' markers
    draining: bool = field(default=False, init=False)  # its server is shutting down (cli)
    dispatcher: Dispatcher | None = field(default=None, init=False)
    lifecycle: LifecycleJobs | None = field(default=None, init=False)
    webhooks: WebhookSender | None = field(default=None, init=False)
    # Business API calls: the dispatcher's and the proxy's, sharing kept connections.
    http: UpstreamClient = field(default_factory=upstream_client, init=False)
    objects: ObjectStore = field(init=False)  # the result store (app/queue/objects.py)
    read_slots: ReadSlots = field(init=False)  # large reads per API key (app/sending.py)
    answers: AnswerCache = field(default_factory=AnswerCache, init=False)  # large statuses
    scrapes: SharedScrape = field(default_factory=SharedScrape, init=False)  # GET /metrics
    _blocking: Redis | None = field(default=None, init=False)
    _embedded: EmbeddedRedis | None = field(default=None, init=False)
    _watchers: list[asyncio.Task[Any]] = field(default_factory=list, init=False)
    _afterwards: set[asyncio.Task[Any]] = field(default_factory=set, init=False)
    _beat: asyncio.Task[None] | None = field(default=None, init=False)

    async def start(self) -> None:
        s = self.settings
        secrets.install(s.keyring)  # its calls open their endpoint's credentials with it
        set_request_timeout(s.sql_timeout_s)
        if s.redis_url:
            self.redis_url = s.redis_url
        else:  # the private server lives and dies with this runtime
            self._embedded = EmbeddedRedis(s.data_dir)
            self.redis_url = await self._embedded.start()
        self.redis = redis_client(self.redis_url, s.redis_timeout_s,
                                  max(512, s.dispatch_concurrency + 64))
        await redis_url.connect(self.redis)
        self.engine = make_engine(s.db_url)
        self.objects = ObjectStore(s.result_store_url)
        self.read_slots = ReadSlots(s.max_large_reads_per_key)
        self.keys = Keys(s.key_prefix, cluster=redis_url.is_cluster(self.redis_url))
        scripts = Scripts.register(self.redis)
        if not self.keys.cluster:
            # Written ahead of what this process sends next (Lua.send, one Redis: a proxied
            # call's ack goes before its caller's last bytes), a script must be in Redis's
            # cache already: met as NOSCRIPT, it runs again only after its reply, behind what
            # followed it. (A Cluster's are sent when awaited: nothing is written ahead.)
            await scripts.ack.load()
            await scripts.budget.load()
        ep_mirror: Mirror[EndpointConfig] = Mirror(
            self.redis, self.keys, "endpoints", EndpointConfig.model_validate,
            lambda: self.endpoints.load_all(), self.keys.live if self.keys.cluster else None)
        self.api_keys = Mirror(self.redis, self.keys, "api_keys", lambda d: ApiKey(**d),
                               lambda: self.key_store.load_all())
        self.endpoints = EndpointStore(self.engine, ep_mirror, s.keyring)
        tiers: Mirror[Tier] = Mirror(self.redis, self.keys, "tiers", lambda d: Tier(**d),
                                     lambda: self.tiers.load_all())
        self.tiers = TierStore(self.engine, tiers)
        self.key_store = KeyStore(self.engine, self.api_keys)
        self.registry = EndpointRegistry(ep_mirror)
        self.queue = TaskQueue(self.redis, self.keys, scripts, s, ResultStore(self.engine),
                               tiers)
        self.events = TaskEvents(self.redis, self.keys)
        # When proxied calls really leave this process (app/proxy/relay.py), as a dispatcher
        # records its own calls'.
        self.send_times = SendTimes(self.redis, self.keys, scripts.sent)
        self.owners = Owners(self.redis, self.keys, self.ident,
                             min(s.lease_ms, s.proxy_owner_ttl_ms))
        for mirror in (ep_mirror, self.api_keys, tiers):
            await mirror.refresh()
            self._watchers.append(asyncio.create_task(mirror.watch()))
            self._watchers.append(asyncio.create_task(mirror.keep_reconciled()))
        if self.with_dispatcher:
            self._blocking = redis_client(self.redis_url, s.redis_timeout_s + 2)
            await redis_url.connect(self._blocking)
            self.dispatcher = Dispatcher(self.redis, self._blocking, self.keys, scripts,
                                         self.registry, s, self.http, self.objects)
            self.dispatcher.start()
            # Outbox writer, pending expiry and janitor run where dispatchers run.
            self.lifecycle = LifecycleJobs.build(s, self.redis, self.keys, scripts,
                                                 self.registry, self.engine, self.objects)
            self.lifecycle.start()
            self.webhooks = WebhookSender(self.redis, self.keys, scripts, self.registry,
                                          self.api_keys, s, self.queue.finished_view)
            self.webhooks.start()
            # Dispatchers have no port: the container's health check reads this heartbeat.
            # Its Redis heartbeat (who is alive, in flight) rides on the same beat.
            dispatcher = self.dispatcher
            self._beat = asyncio.create_task(beat(
                self.redis, heartbeat_path(s),
                lambda: heartbeats.announce(self.redis, self.keys, dispatcher)))
            self._watchers.append(self._beat)

    def afterwards(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` in the background, beyond the request that started it (a proxied call's
        ack retried through an outage); cancelled at stop."""
        task = asyncio.create_task(work)
        self._afterwards.add(task)
        task.add_done_callback(self._afterwards.discard)

    async def retire_endpoint(self, endpoint_id: str) -> None:
        """Delete an endpoint, only an idle one (409 otherwise), so no task is stranded in a
        queue nobody serves any more. It leaves the Redis registry first: from then on no
        submit is admitted for it, however stale a process's own copy (submit-11.lua checks
        the registry in the script that enqueues), so the idle check that follows is final.
        If that check (or anything after it) fails, it is put back from SQL. Its finished
        tasks reach SQL before it goes: the outbox writer serves the endpoints that exist."""
        await self.queue.ensure_idle(endpoint_id)
        await self.endpoints.get(endpoint_id)  # 404 before anything changes
        await self.endpoints.mirror.put(endpoint_id, None, hold_s=RETIRE_HOLD_S)
        try:
            await self.queue.ensure_idle(endpoint_id)
            store = self.queue.results or ResultStore(self.engine)
            writer = OutboxWriter(self.redis, self.keys, self.registry, store,
                                  done_ms=self.queue.ttls.done_ms, objects=self.objects)
            await bounded(writer.write(endpoint_id))
            await self.endpoints.delete(endpoint_id)
        except BaseException:
            await self.endpoints.restore(endpoint_id)
            raise
        # What its owners read already goes now, rows and result objects: no writer serves
        # the delivered tasks of an endpoint that is gone (its unread ones stay, as SQL rows,
        # for the janitor's retention). Best effort: the endpoint is deleted either way.
        try:  # a few batches; bounded as a job's, since a 503 here would undo nothing
            await bounded(writer.forget_delivered(endpoint_id), SQL_JOB_TIMEOUT_S)
        except STORE_ERRORS as exc:
            log.warning("endpoint %s deleted; its delivered tasks not yet (%s): the janitor "
                        "and the result store's sweep will", endpoint_id, exc)
        # Its counters and history go with it: an endpoint created again under this id
        # starts from zero instead of showing the old one's numbers.
        await self.redis.delete(self.keys.stats(endpoint_id), self.keys.history(endpoint_id))

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop; in-flight calls get `grace_s` (default QGW_SHUTDOWN_GRACE_S) to finish."""
        if self.dispatcher:
            await self.dispatcher.stop(grace_s)
            if self._beat is not None:  # a beat after the goodbye would bring it back
                await cancel_all([self._beat])
            with contextlib.suppress(RedisError, OSError):
                await heartbeats.forget(self.redis, self.keys, self.dispatcher.ident)
        if self.lifecycle:  # after the dispatcher: its last acks reach SQL too
            await self.lifecycle.stop()
        if self.webhooks:
            await self.webhooks.stop()
        await cancel_all([*self._watchers, *self._afterwards])
        await self.events.stop()
        await self.send_times.close()
        await self.owners.close()
        await self.http.close()
        for client in (self._blocking, self.redis):
            if client is not None:
                await client.aclose()
        await settle()
        await self.engine.dispose()
        if self._embedded:
            await asyncio.to_thread(self._embedded.stop)
