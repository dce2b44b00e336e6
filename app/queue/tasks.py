"""Submit, status, cancel and complete: each one Redis round trip (one script).

A task Redis no longer holds may be in SQL (app/lifecycle): status, cancel and complete then
make one SQL lookup, off the hot path."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app import permits
from app.core.clock import queue_time
from app.core.keys import Keys, endpoint_of
from app.core.loop import STORE_ERRORS
from app.core.registry import Mirror
from app.core.scripts import Lua, Scripts
from app.endpoints import EndpointConfig
from app.errors import ApiError
from app.lifecycle import Ttls
from app.lifecycle.records import DEAD_LETTERS, fields_of
from app.lifecycle.results import ResultStore
from app.models import Permit, SubmitRequest, SubmitResponse, TaskStatus, TaskType, TaskView
from app.queue.answers import EXTERNAL, ResultMeta
from app.queue.fairness import PRIORITY_STEP, fair_ahead, fair_arg, starvation_keys
from app.queue.ids import new_task_id
from app.queue.reservations import Reservation, Reservations
from app.settings import Settings
from app.store import ApiKey
from app.tiers import Tier, weight_of
from app.timefmt import rfc3339

IDEMPOTENCY_TTL_MS = 24 * 3600 * 1000
log = logging.getLogger(__name__)


@dataclass(slots=True)
class Followup:
    """A script call that goes with a submit's, after it in its round trip (one write on one
    Redis, a pipeline to the same master on a Cluster: the two share the endpoint's slot)."""

    lua: Lua
    keys: list[Any]
    args: list[Any]
    reply: Any = None  # its reply, or the exception it met, once the submit has returned
    #: Run once the two are on their way (on one Redis: written; on a Cluster, sent when
    #: awaited, just after), while Redis runs them: the caller's work that does not need
    #: their answer. It must not raise.
    meanwhile: Callable[[], None] | None = None


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value) if value else "{}"  # most have none: no encoder run for them


async def _caught(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except (RedisError, OSError) as exc:
        return exc


@dataclass
class TaskQueue:
    redis: Redis
    keys: Keys
    scripts: Scripts
    settings: Settings
    results: ResultStore | None = None
    tiers: Mirror[Tier] | None = None  # weights of `fairness: weighted` (app/tiers.py)

    @cached_property
    def ttls(self) -> Ttls:
        return Ttls.of(self.settings)

    @cached_property
    def reservations(self) -> Reservations:
        s = self.settings
        return Reservations(self.redis, self.keys, self.scripts, self.results,
                            s.redis_wait_replicas, s.redis_timeout_s + 0.5,
                            IDEMPOTENCY_TTL_MS)

    async def submit(
        self, key: ApiKey, endpoint: EndpointConfig, req: SubmitRequest, idem_key: str | None,
        precheck: bool = True, task_id: str | None = None, then: Followup | None = None,
        owner: tuple[str, int] | None = None,
    ) -> SubmitResponse | str:
        """Enqueue; returns the response, or the id of the task an Idempotency-Key names.
        `precheck`: a task with `max_wait_s` is refused (409) when the estimate says it would
        not start in time; without it, the caller reads the answer's `wait_time` itself.
        `task_id`: the new task's (new_task_id), for a caller that names it in `then`.
        `then`: the caller's claim of the task itself, should it be first in line (a proxied
        request, ProxyCall): it goes in the submit's round trip, and no dispatcher is woken
        for a task it may claim. `owner`: the marker of the API process holding the caller of
        a proxied request and its TTL (app/queue/owners.py), which a claim checks while the
        task waits."""
        e, k, user_id = endpoint.id, self.keys, key.user_id
        task_id = task_id or new_task_id(e)
        if self.settings.redis_wait_replicas:
            # Confirmed by replicas, a submit may be refused after it ran: alone, it wakes the
            # dispatchers as any submit does (no claim of the caller's then).
            then = None
        fields: list[str | int] = [
            "user_id", user_id, "type", req.task_type, "priority", req.priority,
            "method", req.http_method, "url", req.target_url, "body", req.body,
            "headers", _json(req.headers), "query", _json(req.query_params),
            "client_ts", req.timestamp or "",
        ]
        if owner is not None:
            fields += ["owner", owner[0], "owner_ms", owner[1]]
        if req.callback_url:  # its webhook is signed with the secret of the key that asked
            fields += ["callback_url", req.callback_url, "key_id", key.id]
        if req.cost != 1:  # what it spends of per-cost limits (claim-12.lua; absent = 1)
            if endpoint.max_cost is not None and req.cost > endpoint.max_cost:
                raise ApiError(422, "cost_too_high", f"cost {req.cost} exceeds what a limit of "
                               f"{e!r} admits in a whole interval ({endpoint.max_cost})")
            fields += ["cost", req.cost]
        idem = k.idempotency(user_id, idem_key) if idem_key else k.idempotency(user_id, "-")
        pending_ms, own_deadline = self.ttls.pending_ms, False
        if req.max_wait_s is not None:
            if precheck:
                await self._check_deadline(endpoint, req, user_id, idem if idem_key else None,
                                           self._weight(key))
            own_deadline = req.max_wait_s * 1000 < pending_ms
            pending_ms = min(pending_ms, req.max_wait_s * 1000)
        user_keys = [idem, k.quota(user_id)]
        user_args = [task_id, "1" if idem_key else "0", IDEMPOTENCY_TTL_MS, key.daily_quota]
        # On a Cluster the caller's keys are in another slot than the queue: taken first, on
        # their own (app/queue/reservations.py), and stand-ins in the queue's slot turn them
        # off in submit-11.lua.
        held = self.reservations.reservation(
            user_keys, task_id, idem_key is not None, key.daily_quota) if k.cluster and (
            idem_key is not None or key.daily_quota > 0) else None
        own_keys, own_args = ((user_keys, user_args[1:]) if not k.cluster
                              else ([k.queue(e)] * 2, ["0", 0, 0]))
        try:
            res = await self.reservations.take(held, user_id) if held else ["ok"]
            if res[0] == "ok":
                res = await self._enqueue(task_id, *self._submit_call(
                    task_id, endpoint, req, own_keys, own_args, pending_ms, own_deadline, fields,
                    fair_arg(endpoint, user_id, self._weight(key)), then is not None), then)
                if held and res[0] in ("gone", "full"):
                    await self._unreserve(held)
                elif held and res[0] == "ok":
                    await self.reservations.confirm(held)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _maybe_queued(task_id, e, idem_key, exc) from None
        if res[0] == "dup":
            return str(res[1])
        if res[0] == "gone":  # deleted; this process has not heard yet
            raise ApiError(404, "endpoint_not_registered",
                           "target_url matches no registered, enabled endpoint")
        if res[0] == "quota":
            retry = max(1, int(res[1]) // 1000 + 1)
            raise ApiError(429, "quota_exceeded",
                           f"the daily quota of {key.daily_quota} tasks is used up",
                           {"Retry-After": str(retry)})
        if res[0] == "full":
            raise ApiError(503, "queue_full", f"the queue of {e!r} is full",
                           {"Retry-After": "5"})
        ahead = int(res[2])
        return SubmitResponse(task_id=task_id, task_status=TaskStatus.PENDING,
                              created_at=rfc3339(res[3]), wait_num=ahead,
                              wait_time=wait_seconds(endpoint, ahead, res[4]))

    def _submit_call(
        self, task_id: str, endpoint: EndpointConfig, req: SubmitRequest, user_keys: list[str],
        user_args: list[Any], pending_ms: int, own_deadline: bool, fields: list[str | int],
        fair: str, claims_itself: bool,
    ) -> tuple[list[str], list[Any]]:
        """submit-11.lua's KEYS and ARGV; `user_keys`/`user_args`: the Idempotency-Key and
        quota (keys, then honour flag, TTL, quota), or on a Cluster stand-ins that turn them
        off (reserve-2.lua took them)."""
        k, e = self.keys, endpoint.id
        honour, idem_ttl, quota = user_args
        return (
            [k.queue(e), k.task(task_id), k.seq(e), k.wake(e), *user_keys, k.live(e),
             *k.of(e, "deadlines", "stats", "active"), k.turns(e, req.priority),
             *k.of(e, *starvation_keys(endpoint))],
            [task_id, e, req.priority, endpoint.max_queue_len, pending_ms, honour, idem_ttl,
             quota, self.ttls.done_ms, "1" if own_deadline else "0",
             fair,
             req.cost if endpoint.max_cost is not None else "", "1" if claims_itself else "0",
             *fields],
        )

    def _weight(self, key: ApiKey) -> int:
        return weight_of(self.tiers, key.tier)

    async def _unreserve(self, held: Reservation) -> None:
        try:
            await self.reservations.give_back(held)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            # The count stays one too high for today; the key names a task that never was,
            # which the next submit with it finds out (Reservations.take).
            log.warning("could not give back a quota reservation: %s", exc,
                        extra={"task_id": held.args[0]})

    async def _check_deadline(self, endpoint: EndpointConfig, req: SubmitRequest,
                              user_id: int, idem: str | None, weight: int) -> None:
        """409 when a task submitted now would not start within `max_wait_s` by the estimate.
        A read before the submit, only for callers who set a deadline: a task queued and then
        withdrawn would already hold its Idempotency-Key. A resend whose key already names a
        task is never refused: the submit answers with that task (read in the same trip)."""
        k, e, priority, max_wait_s = self.keys, endpoint.id, req.priority, req.max_wait_s or 0
        async with self.redis.pipeline(transaction=False) as pipe:
            # Ahead of it: every task of its priority or higher (submit-11.lua's score).
            pipe.zcount(k.queue(e), "-inf", f"({(1 - priority) * PRIORITY_STEP}")
            pipe.zcard(k.active(e))
            pipe.hmget(k.stats(e), *MEASURED_FIELDS)
            queue_time(pipe, k.stats(e))
            if idem is not None:
                pipe.exists(idem)
            ahead, in_flight, m, (secs, micros), *known = await pipe.execute()
        if known and known[0]:
            return
        if endpoint.fairness != "fifo":  # its turn, not the whole band, is ahead of it
            ahead = await fair_ahead(self.redis, k, e, priority, user_id,
                                     weight if endpoint.fairness == "weighted" else 0)
        if endpoint.paused:
            raise ApiError(409, "endpoint_paused",
                           f"{e!r} is paused by its operator: when it starts again is unknown, "
                           "so no wait can be promised (submit without max_wait_s to queue)",
                           wait_num=ahead)
        now = int(secs) * 1000 + int(micros) // 1000
        estimate = estimate_wait(endpoint, ahead, [m[0], m[1], in_flight, m[2], m[3], now, *m[4:]])
        if estimate > max_wait_s:
            raise ApiError(409, "deadline_unreachable",
                           f"the estimated wait ({math.ceil(estimate)} s) already exceeds "
                           f"max_wait_s ({max_wait_s} s)", wait_time=math.ceil(estimate),
                           wait_num=ahead)

    async def _enqueue(self, task_id: str, keys: list[str], args: list[Any],
                       then: Followup | None = None) -> Any:
        """The submit script, with `then` after it in the same round trip; with
        QGW_REDIS_WAIT_REPLICAS (never with `then`), answered only once that many replicas
        have it, so a failover cannot lose an acknowledged task."""
        replicas = self.settings.redis_wait_replicas
        if then is not None:  # never with replicas to confirm (submit)
            both = Lua.together(self.redis, [
                (self.scripts.submit, keys, args), (then.lua, then.keys, then.args)])
            if then.meanwhile is not None:
                then.meanwhile()
            res, then.reply = await both
            if isinstance(res, NoScriptError):  # neither ran (Redis restarted): one by one
                res = await self.scripts.submit(keys=keys, args=args)
                then.reply = None
            if isinstance(res, BaseException):
                raise res
            if then.reply is None or isinstance(then.reply, NoScriptError):
                then.reply = await _caught(then.lua(keys=then.keys, args=then.args))
            return res
        if not replicas:
            return await self.scripts.submit(keys=keys, args=args)
        # Within the socket timeout, so a slow replica reads as itself, not as Redis down.
        timeout_ms = max(1, int(self.settings.redis_timeout_s * 500))
        res, acked = await self.scripts.submit.call_and_wait(keys, args, replicas, timeout_ms)
        if acked < replicas and res[0] == "ok":
            # Queued on the master only: a failover now could lose it. Not acknowledged, so
            # the client retries; with the same Idempotency-Key that retry is safe.
            log.warning("submit not confirmed by %d of %d replicas", replicas - acked, replicas,
                        extra={"task_id": task_id})
            raise ApiError(503, "redis_unavailable",
                           f"the task was queued but {acked} of {replicas} Redis replicas "
                           "confirmed it in time; retry with the same Idempotency-Key",
                           {"Retry-After": "1"}, task_id=task_id)
        return res

    async def status(self, user_id: int, task_id: str, endpoint: EndpointConfig | None,
                     deliver: bool = True, result_limit: int = 0) -> TaskView:
        """The task as its owner sees it. A finished task read with `deliver` has reached its
        owner (its copies go soon); a repeated submit only peeks: it carries no result.
        With `result_limit`, a longer inline result is left out (`result_left_out`)."""
        fields, rank, measured = await self.fields(user_id, task_id, deliver, result_limit)
        return self._view(task_id, fields, rank, measured, endpoint)

    async def fields(self, user_id: int, task_id: str, deliver: bool = True,
                     result_limit: int = 0) -> tuple[dict[str, str], int | None, Any]:
        """The task's fields as its hash has them (from SQL once Redis has let it go), its
        place in line and what status-6.lua measured of its endpoint (`measured`; None from
        SQL); with
        `result_limit`, a longer `result` is replaced by `result_omitted` (its length)."""
        k, e = self.keys, endpoint_of(task_id)
        res = await self.scripts.status.repeatable(
            keys=[k.task(task_id), *k.of(e, "queue", "stats", "outbox", "delivered", "active")],
            args=[task_id, user_id, self.ttls.read_ms if deliver else 0,
                  self.ttls.read_external_ms, result_limit],
        )
        if not res:
            return await self._finished_fields(user_id, task_id, deliver, result_limit), None, None
        return dict(zip(res[2::2], res[3::2], strict=True)), res[0], res[1]

    def finished_view(self, task_id: str, fields: dict[str, str]) -> TaskView:
        """A finished task as its owner reads it, from its hash (the webhooks' body)."""
        return self._view(task_id, fields, None, None, None)

    def _view(
        self, task_id: str, f: dict[str, str], rank: int | None, measured: Any,
        endpoint: EndpointConfig | None,
    ) -> TaskView:
        status = TaskStatus(f["status"])
        ttype = TaskType(f["type"])
        wait_num = int(rank) if rank is not None else 0
        permit = None
        if ttype is TaskType.ONLINE and status is TaskStatus.PROCESSING and f.get("deadline"):
            expires = int(f["deadline"])
            permit = Permit(token=permits.sign(self.settings.permit_key, task_id, expires),
                            expires_at=rfc3339(expires) or "")
        code = f.get("result_status_code")
        result, meta = f.get("result"), ResultMeta.loads(f.get("result_meta"))
        size = meta.size if meta else (len(result.encode()) if result is not None else None)
        if (omitted := f.get("result_omitted")) is not None and meta is None:
            size = int(omitted)  # an inline text's size is its length
        view = TaskView(
            task_id=task_id, task_type=ttype, task_status=status,
            task_result=None if meta and meta.encoding == EXTERNAL else result,
            wait_num=wait_num,
            wait_time=(wait_seconds(endpoint, wait_num, measured) if rank is not None
                       else math.ceil(_retry_wait(status, f.get("retry_at"), measured))),
            created_at=rfc3339(f.get("created_at")), started_at=rfc3339(f.get("started_at")),
            ended_at=rfc3339(f.get("ended_at")),
            result_status_code=int(code) if code else None,
            attempts=int(f.get("attempts", 0)), permit=permit,
            result_encoding=(meta.encoding or None) if meta else None,
            result_content_type=meta.content_type if meta else None,
            result_bytes=size if status.finished else None,
        )
        view._left_out = omitted is not None
        return view

    async def cancel(self, user_id: int, task_id: str, expire: bool = False) -> TaskStatus:
        """Cancelled, pending or running (its call aborted); with `expire`, a pending task ends
        `expired` (its caller's own max wait ran out) and a running one is left to run (409)."""
        k, e = self.keys, endpoint_of(task_id)
        res = await self.scripts.cancel(
            keys=[k.task(task_id),
                  *k.of(e, "queue", "active", "wake", "outbox", "retry", "stats", "hooks",
                        "probe")],
            args=[task_id, user_id, self.ttls.done_ms, e, *(["expire"] if expire else [])],
        )
        if res[0] == "missing":
            res = ["conflict", await self._finished_status(user_id, task_id)]
        if res[0] == "conflict":
            raise ApiError(409, "task_not_cancellable",
                           f"task {task_id!r} is {res[1]} and cannot be cancelled",
                           task_status=res[1])
        return TaskStatus.EXPIRED if res[0] == "expired" else TaskStatus.CANCELLED

    async def complete(self, user_id: int, task_id: str, result: str | None) -> TaskStatus:
        """An admitted online task is done: its slot frees before the permit runs out."""
        k, e = self.keys, endpoint_of(task_id)
        res = await self.scripts.complete(
            keys=[k.task(task_id),
                  *k.of(e, "active", "queue", "wake", "outbox", "stats", "hooks", "probe")],
            args=[task_id, user_id, result or "", self.ttls.done_ms, e],
        )
        if res[0] == "missing":
            res = ["conflict", await self._finished_status(user_id, task_id)]
        if res[0] == "conflict":
            raise ApiError(409, "task_not_completable",
                           f"task {task_id!r} is {res[1]}; only an admitted online task can be "
                           "completed", task_status=res[1])
        return TaskStatus.COMPLETED

    async def ensure_idle(self, endpoint_id: str) -> None:
        """409 while an endpoint has tasks waiting or running: deleting it would strand them
        (nobody claims, reaps or expires the tasks of an endpoint that is gone)."""
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(k.queue(endpoint_id))
            pipe.zcard(k.active(endpoint_id))
            pipe.zcard(k.retry(endpoint_id))
            pipe.zcard(k.hooks(endpoint_id))
            pending, in_flight, retrying, hooks = await pipe.execute()
        pending += retrying
        if pending or in_flight:
            raise ApiError(409, "endpoint_busy",
                           f"{endpoint_id!r} has {pending} tasks waiting and {in_flight} "
                           "running; disable it and let them finish (or cancel them) first",
                           pending=pending, in_flight=in_flight)
        if hooks:  # nobody would deliver them once it is gone
            raise ApiError(409, "endpoint_busy",
                           f"{endpoint_id!r} has {hooks} webhooks not delivered yet; retry "
                           "once they are (or given up, an hour after their tasks ended)",
                           pending=0, in_flight=0)

    async def _finished_row(self, user_id: int, task_id: str, result_limit: int = 0) -> Any:
        """The SQL row of a task Redis has let go; 404 without one, 503 when SQL is down.
        With `result_limit`, a longer result is left in the database (ResultStore.get)."""
        row = None
        if self.results is not None:
            try:
                row = await self.results.get(task_id, user_id, result_limit)
            except STORE_ERRORS:
                raise ApiError(503, "database_unavailable",
                               "finished tasks are unavailable; retry shortly",
                               {"Retry-After": "5"}) from None
        if row is None:
            raise ApiError(404, "task_not_found", f"no task {task_id!r}")
        return row

    async def _finished_status(self, user_id: int, task_id: str) -> str:
        return str((await self._finished_row(user_id, task_id)).status)

    async def _finished_fields(self, user_id: int, task_id: str, deliver: bool,
                               result_limit: int = 0) -> dict[str, str]:
        """A task's fields from SQL. Read by its owner, the row is delivered like a Redis
        copy: it goes once the read TTL has passed (NX: reading again does not postpone it).
        With `result_limit`, a longer result is `result_omitted` (its size), as in Redis."""
        row = await self._finished_row(user_id, task_id, result_limit)
        if deliver and row.status not in DEAD_LETTERS:  # those stay for operators
            meta = ResultMeta.loads(row.result_meta)
            ttl = self.ttls.read_external_ms if meta and meta.encoding == EXTERNAL else \
                self.ttls.read_ms
            due = int(time.time() * 1000) + ttl  # seconds of skew do not matter
            await self.redis.zadd(self.keys.delivered(endpoint_of(task_id)), {task_id: due},
                                  nx=True)
        fields = fields_of(row)
        if result_limit and row.result_omitted is not None:
            fields["result_omitted"] = str(row.result_omitted)  # left in SQL: a large read
        return fields


def _maybe_queued(task_id: str, e: str, idem_key: str | None, exc: Exception) -> ApiError:
    """Redis did not answer a submit. It may have run it all the same (a stalled Redis runs
    what it buffered once it resumes; a reply can be lost with its connection), so the 503
    must not read as "not queued", and says how to retry without a second task."""
    log.warning("redis unavailable during a submit: %s", exc,
                extra={"task_id": task_id, "endpoint": e})
    how = ("retry with the same Idempotency-Key: that answers with this task if it was "
           "queued, and never makes a second one" if idem_key else
           f"this request had no Idempotency-Key: check GET /api/v1/tasks/{task_id} before "
           "submitting again, and send one to retry safely")
    return ApiError(503, "redis_unavailable",
                    f"the queue store did not answer; the task may have been queued as "
                    f"{task_id}: {how}", {"Retry-After": "1"}, task_id=task_id)


def wait_seconds(endpoint: EndpointConfig | None, ahead: int, measured: Any) -> int | None:
    """`estimate_wait` as the answers carry it: whole seconds, rounded up. The go-zero
    service's clients decode `wait_time` as an int64, and Go refuses `1.75` (even `2.0`)
    for one, failing the whole answer. None while an operator has paused the endpoint: it
    starts nothing until someone resumes it, which no figure can foretell (a null reads as
    0 to those clients, without an error)."""
    if endpoint is not None and endpoint.paused:
        return None
    return math.ceil(estimate_wait(endpoint, ahead, measured))


# The stats fields the wait estimate reads (status-6.lua and submit-11.lua read the same, in
# this order, into `measured`: {exec, slot, in flight, last admission, upstream pause, now,
# limited until, average cost, adaptive limit}).
MEASURED_FIELDS = ("exec_ms", "slot_ms", "last_admit", "upause", "limited_until", "cost_avg",
                   "alimit")
PACED_COST_MS = 60_000  # per-cost sliding limits up to this long pace units (limits.lua)


def estimate_wait(endpoint: EndpointConfig | None, ahead: int, measured: Any) -> float:
    """Seconds until a task with `ahead` tasks before it in line starts.

    It waits for the slowest of what holds it back (docs/design.md, "Estimated wait"):
    - the concurrency cap C: the task starts once `ahead + 1 - free` slots have been given
      back, free = C - in flight.  Slots come back at C / slot time, the slot time being
      measured by the scripts from claim to finish (the calls of one attempt: a task waiting
      out a retry back-off gives its slot back, retry-8.lua; a moving average of recent
      tasks; `avg_exec_ms` until there is one).  Under a backlog the next slot comes back on
      average half a gap from now, so the n-th after (n - 1/2) gaps; counting from "now"
      rather than "a full gap" is what keeps the estimate unbiased for the first tasks in line.
    - the limits (`rate` and every one of `limits`): the head of the line waits until the
      limiter admits again (the claim records when, `limited_until`, whichever limit refused;
      for the main rate also one emission after the last admission), the rest for their share
      of each limit, a per-cost limit counting each task ahead at the recent average cost.
    With neither, the tasks in flight stand for the cap (the dispatchers' capacity).
    - the upstream's own pause (lua/includes/upstream.lua): nothing starts before it ends.
    `measured` is status-6.lua's list (MEASURED_FIELDS, with in flight third and now sixth);
    a shorter list, or a bare exec time (in flight unknown: taken as a full endpoint) is
    accepted too.
    """
    if endpoint is None:
        return 0.0
    m = [*measured, *[None] * 9][:9] if isinstance(measured, (list, tuple)) else [measured]
    exec_ms, slot_ms, flight, last_admit, paused_until, now, limited, cost, learnt = \
        [*m, *[None] * 9][:9]
    in_flight = int(flight) if flight is not None else None
    wait = 0.0
    cap = current_cap(endpoint, learnt)
    if cap == 0 and endpoint.rate == 0 and in_flight:
        # No limit of its own: with tasks in line, what runs now is all the dispatchers give
        # it (their capacity), and that observed parallelism sets the pace.
        cap = in_flight
    if cap > 0:
        slot_s = float(slot_ms or exec_ms or endpoint.avg_exec_ms) / 1000
        free = cap - in_flight if in_flight is not None else 0
        behind = ahead + 1 - max(0, free)  # slots that must come back before it starts
        if behind > 0:
            wait = (behind - 0.5) * slot_s / cap
    now_ms = int(now) if now else None
    pause_end = (int(paused_until) if endpoint.honor_upstream_limits and paused_until
                 and now_ms and int(paused_until) > now_ms else None)
    # What holds the head past the pause, counted from the pause's end, which is added below
    # (a claim the pause held wrote that end as its `limited_until`: not counted twice).
    head = (max(0.0, (int(limited) - (pause_end or now_ms)) / 1000) if limited and now_ms
            else 0.0)
    wait = max(wait, head, _limits_wait(endpoint, ahead, head, last_admit, pause_end or now_ms,
                                        float(cost or 1)))
    if pause_end and now_ms:
        wait += (pause_end - now_ms) / 1000  # its upstream admits nothing till then
    return round(wait, 3)


def current_cap(endpoint: EndpointConfig, learnt: Any) -> int:
    """The cap the claim admits to now: the configured one, or an adaptive endpoint's learnt
    limit (lua/includes/adaptive.lua `alimit`; its minimum until one is learnt)."""
    if endpoint.concurrency != "adaptive":
        return endpoint.max_concurrency
    limit = math.floor(float(learnt)) if learnt else endpoint.min_concurrency
    return min(endpoint.max_concurrency, max(endpoint.min_concurrency, limit))


def _limits_wait(endpoint: EndpointConfig, ahead: int, head: float, last_admit: Any,
                 now: int | None, avg_cost: float) -> float:
    """How long the limits hold the task with `ahead` before it, the head of the line held
    `head` seconds (the limiter's own word); counted from `now` (ms: a pause's end when the
    upstream paused the endpoint, which the caller adds)."""
    wait = 0.0
    if endpoint.rate > 0:
        # The limiter paces admissions one emission apart: the head of the line waits for the
        # one after the last admission (a minute, on a 1-a-minute endpoint), the rest for one
        # emission each.
        emission = endpoint.interval_ms / 1000 / endpoint.rate
        if last_admit and now:
            head = max(head, (int(last_admit) - now) / 1000 + emission)
        wait = head + ahead * emission
    for limit in endpoint.limits:
        # A further limit lets `rate` units through per interval: a request 1 a task, a cost
        # the recent average. A paced per-cost limit (limits.lua) spreads them evenly; the
        # others admit a window's worth at once, each full window ahead one more interval.
        units = ahead * (avg_cost if limit.per == "cost" else 1.0)
        windows = units / limit.rate
        paced = (limit.per == "cost" and limit.limiter == "sliding_window"
                 and limit.interval_ms <= PACED_COST_MS)
        wait = max(wait, head + (windows if paced else math.floor(windows))
                   * limit.interval_ms / 1000)
    return wait


def _retry_wait(status: TaskStatus, retry_at: str | None, measured: Any) -> float:
    """Seconds until a task waiting out a retry back-off is back in line (0 for any other),
    by the Redis clock that set `retry_at` (status-6.lua's `now`, sixth in `measured`)."""
    if status is not TaskStatus.PENDING or not retry_at or not isinstance(measured, list) \
            or len(measured) < 6 or measured[5] is None:
        return 0
    return max(0.0, (int(retry_at) - int(measured[5])) / 1000)
