"""A proxied request's way through the line: submitted as a task of type `proxy` (the online
path: same priority, fairness, limits, cap, pauses, quotas). Its own claim (claim-12.lua `only`)
goes with the submit, in its round trip: when the rules a dispatcher's claim follows admit it
first, it is admitted there and then (not a dispatcher's wake, its claim, a status event and a
read later). Otherwise a dispatcher's claim admits it, which this process hears as a status
event (no polling). Then this process makes the call, renews the lease while the answer
streams, and finishes the task through the ack script (settling the cost, counting the stats)
like a dispatcher finishes a queued call: written to Redis before the answer's last bytes go to
the caller, its reply read after.

The lease is what a process killed mid-stream leaves behind: the reaper ends the task `failed`
("caller connection lost", lua/reap-7.lua) when it lapses, and never runs it again. One killed
while its requests wait leaves their tasks naming its marker, which lapses (app/queue/owners.py):
a claim ends them, and one a dispatcher admitted holds only a short pickup lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from redis.exceptions import RedisError

from app import secrets, tracing
from app.core.interrupt import Interrupt
from app.core.keys import Keys
from app.core.loop import persist
from app.endpoints import EndpointConfig
from app.errors import ApiError
from app.models import Method, SubmitRequest, SubmitResponse
from app.proxy.calls import EndpointCalls, endpoint_calls
from app.proxy.paths import upstream_url
from app.queue.claims import CLAIM_FIELDS, asked_pause_ms, pause_left_ms, settle_limits
from app.queue.fairness import starvation_keys
from app.queue.http1 import Answer, BadAnswer, Target
from app.queue.ids import new_task_id
from app.queue.signals import pause_s, remaining
from app.queue.tasks import Followup
from app.queue.upstream import CREDENTIALS_LOST
from app.ratelimit.sent import sliding_logs
from app.runtime import Runtime
from app.store import ApiKey

log = logging.getLogger(__name__)
CALLER_LOST = "caller connection lost"
CALLER_STALLED = "the caller stopped reading its answer"


class CallerGone(Exception):
    """The caller closed its connection."""


@dataclass
class ProxyCall:
    rt: Runtime
    caller: ApiKey
    endpoint: EndpointConfig
    method: str
    url: str
    headers: list[tuple[str, str]]  # what goes to the upstream (the gateway's own removed)
    body: bytes
    priority: int
    max_wait_s: float
    cost: int
    idem_key: str | None
    gone: asyncio.Future[Any]  # done once the caller has disconnected
    path: tuple[str, str]  # `url` past target_url: the raw path and the query (_current)
    arrived: float = field(default_factory=time.monotonic)
    task_id: str = ""
    token: str = ""
    admitted: float = 0.0
    admitted_at: float = 0.0  # loop time its claim admitted it (the latest claim's)
    spent: int = 1  # what that admission spent of per-cost limits (the task's `cost`)
    call_started: float = 0.0
    lease_until: float = 0.0  # monotonic: when the lease lapses unless renewed (_acked)
    _head: tuple[Target, bytes] | None = None  # the call's, built with the submit (_prepare)
    _renewing: asyncio.Task[None] | None = None
    _renewal_due: asyncio.TimerHandle | None = None  # before the first renewal (no task yet)
    trace: tracing.ProxyTrace | None = None  # its `proxy` span, when tracing is on
    # Done once a renewal found the lease gone (a future, not an Event: waited on as it is).
    lease_lost: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def keys(self) -> Keys:
        return self.rt.keys

    @property
    def waited_ms(self) -> int:
        return round((self.admitted - self.arrived) * 1000)

    # -- in line -----------------------------------------------------------------------------

    async def submit(self) -> None:
        """Into the line; claimed at once, in the submit's own round trip, when the rules a
        dispatcher's claim follows admit it first (its lease token is then set)."""
        # Built, not validated (the route checked the request): its method is one the endpoint
        # accepts, and `proxy` is a task type only the gateway makes, never a caller's.
        req = SubmitRequest.model_construct(
            target_url=self.url, http_method=cast(Method, self.method), body="",
            priority=self.priority, timestamp=None,
            task_type="proxy",  # type: ignore[arg-type]
            headers={}, query_params={}, callback_url=None,
            cost=self.cost, max_wait_s=max(1, math.ceil(self.max_wait_s)))
        self.task_id = new_task_id(self.endpoint.id)
        own = None if self.endpoint.paused else self._own_claim()
        # No estimate read before the submit (a round trip and a fifth of the request's
        # CPU): the submit's answer says how long the wait looks; one too long withdraws.
        asked = asyncio.get_running_loop().time()
        res = await self.rt.queue.submit(self.caller, self.endpoint, req, self.idem_key,
                                         precheck=False, task_id=self.task_id, then=own,
                                         owner=self.rt.owners.marker(self.endpoint.id))
        if not isinstance(res, SubmitResponse):  # a repeated Idempotency-Key
            raise ApiError(409, "duplicate_request", f"this Idempotency-Key made task "
                           f"{res!r}; a proxied request is answered once, on its own "
                           "connection", task_id=res)
        if own is not None and await self._claimed(own.reply, asked):
            return
        self._head = None  # it waits: built again when admitted
        if res.wait_time is not None and req.max_wait_s and res.wait_time > req.max_wait_s:
            await self._give_up(res.wait_time)  # the line promises too long a wait

    @property
    def calls(self) -> EndpointCalls:
        s = self.rt.settings
        return endpoint_calls(self.keys, self.endpoint, s.lease_ms, s.rate_guard_ms)

    def _own_claim(self) -> Followup:
        """claim-12.lua for this one task (`only`): it claims it if it is the first the
        dispatchers' claim would; otherwise what it leaves is theirs, as after any claim."""
        calls = self.calls
        return Followup(self.rt.queue.scripts.claim, calls.claim_keys,
                        calls.claim_argv(f"proxy.{os.urandom(8).hex()}", self.task_id),
                        meanwhile=self._prepare)

    async def _claimed(self, reply: Any, asked: float) -> bool:
        """Whether its own claim admitted it."""
        if isinstance(reply, BaseException):
            log.warning("could not claim its own task: %s; a dispatcher will", reply,
                        extra=self._extra())
            # The submit may have woken no dispatcher: wake one.
            with contextlib.suppress(RedisError, OSError):
                await self.rt.redis.zadd(self.keys.wake(self.endpoint.id),
                                         {self.endpoint.id: 0}, nx=True)
            return False
        if not isinstance(reply, list) or len(reply) < 3 + CLAIM_FIELDS \
                or reply[3] != self.task_id:
            return False
        self.admitted_at, self.spent = asked, int(reply[3 + CLAIM_FIELDS - 1])
        self._admit(str(reply[4]))
        return True

    async def wait_turn(self) -> None:
        """Until a claim admits the task: its lease token is then ours to call with."""
        if self.token:  # claimed with its submit
            return
        deadline = self.arrived + self.max_wait_s
        # Watched only now, when it has to wait: one admitted with its submit (most, while
        # the line is short) makes this process hear none of its endpoint's events. Read once
        # watched, so an admission since the submit is not missed.
        with self.rt.events.watch(self.task_id) as w:
            while True:
                if await self._admitted():
                    self._current()
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    await self._give_up()
                    continue  # admitted meanwhile: it runs
                changed = asyncio.ensure_future(w.changed(left))
                await asyncio.wait({changed, self.gone}, return_when=asyncio.FIRST_COMPLETED)
                if self.gone.done():
                    changed.cancel()
                    await self.withdraw()
                    raise CallerGone

    async def _admitted(self) -> bool:
        """True once a claim admitted the task (its lease token is ours); False while it
        waits; raises when it ended meanwhile."""
        status, token, age_s, lease_s = await self._state()
        if status == "processing" and token:
            # Another's claim: a pickup lease, as it gave (app/queue/owners.py).
            self._admit(token, age_s, lease_s or None)
            return True
        if status == "expired":  # its max wait (the sweep was first)
            raise _too_long(self.max_wait_s, None, self.task_id)
        if status != "pending":  # cancelled by an operator
            raise ApiError(409, "task_not_pending", f"the request's task is {status}",
                           task_id=self.task_id)
        return False

    def _current(self) -> None:
        """After a wait in line, the endpoint as it is now: an edit meanwhile (its target_url,
        its upstream_headers rotated, its limits, its timeout) is what its call and its ack
        use, as a dispatcher's call would; the URL and the key change together, so a key never
        goes to the host it replaced. Deleted meanwhile: the version it was admitted under."""
        now = self.rt.registry.get(self.endpoint.id)
        if now is None or now is self.endpoint:
            return
        self.endpoint = now
        self.url = upstream_url(now.target_url, *self.path) or self.url

    def _admit(self, token: str, age_s: float = 0.0, lease_s: float | None = None) -> None:
        """Admitted `age_s` ago (by a dispatcher's claim, heard since) with lease `token`, for
        `lease_s` (default: a whole lease)."""
        if lease_s is None:
            lease_s = self.rt.settings.lease_ms / 1000
        self.token, self.admitted = token, time.monotonic()
        self.lease_until = self.admitted - age_s + lease_s
        if self.trace is not None:
            self.trace.task(self.task_id, self.waited_ms)
        # A timer, not a task, until the first renewal is due: most calls end before it.
        self._renewal_due = asyncio.get_running_loop().call_later(
            max(0.0, lease_s / 3 - age_s), self._start_renewing)

    async def _state(self) -> tuple[str | None, str | None, float, float]:
        """The task's status, its lease token, how long ago it was admitted and the lease its
        claim gave (s), once it was (turn-1.lua)."""
        asked = asyncio.get_running_loop().time()
        status, lease, age_ms, cost, granted_ms = await self.rt.queue.scripts.turn(
            keys=[self.keys.task(self.task_id)], args=[])
        # The admission's loop time, rather early than late: the script's way here counts as
        # part of the delay, which moves the window's entry later (the safe side).
        self.admitted_at, self.spent = asked - int(age_ms) / 1000, int(cost or 1)
        return ((None if status is None else str(status)),
                (None if lease is None else str(lease)), int(age_ms) / 1000,
                int(granted_ms) / 1000)

    async def _give_up(self, estimate: float | None = None) -> None:
        """Its max wait is over, or the wait the line promises (`estimate`) is longer: its task
        ends `expired` (as the expiry sweep would end it), out of line, and the caller has its
        503; unless a claim took it meanwhile (admitted within its max wait, it runs), or it
        ended otherwise (an operator's cancel: the caller reads that next)."""
        try:
            await self.rt.queue.cancel(self.caller.user_id, self.task_id, expire=True)
        except ApiError:
            return
        raise _too_long(self.max_wait_s, estimate, self.task_id)

    async def withdraw(self) -> None:
        """The caller left before its call: its task is cancelled, out of line or, admitted
        meanwhile, its slot freed (nothing was called). One that ended already stays."""
        with contextlib.suppress(ApiError):
            await self.rt.queue.cancel(self.caller.user_id, self.task_id)

    # -- the lease ---------------------------------------------------------------------------

    def _start_renewing(self) -> None:
        self._renewal_due = None
        self._renewing = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        """Keep the lease while the call is on (renewed a third of it in, then each third); a
        lost lease (an operator's cancel, a Redis that lost it) aborts the call."""
        lease_ms = self.rt.settings.lease_ms
        k, e = self.keys, self.endpoint.id
        while True:
            asked = time.monotonic()
            try:
                res = await self.rt.queue.scripts.extend(
                    keys=[k.active(e), k.task(self.task_id), k.probe(e)],
                    args=[self.task_id, self.token, lease_ms])
            except (RedisError, OSError) as exc:
                log.warning("lease renewal failed: %s", exc, extra=self._extra())
                # Again within what is left of the lease (a pickup lease is short), not a
                # whole third of a lease later.
                await asyncio.sleep(max(0.25, min(lease_ms / 3000,
                                                  (self.lease_until - time.monotonic()) / 3)))
                continue
            if int(res) < 0:
                if not self.lease_lost.done():
                    self.lease_lost.set_result(None)
                return
            self.lease_until = asked + lease_ms / 1000
            await asyncio.sleep(lease_ms / 3000)

    def traced(self, status_code: int | None, problem: str | None) -> None:
        """End the `proxy` span (when tracing): the caller's status, what went wrong."""
        if self.trace is not None:
            self.trace.end(status_code, problem)

    def abandon(self) -> None:
        """Stop renewing a lease nothing will finish (an unexpected error): it lapses and the
        reaper ends the task, as if this process had died."""
        self._stop_renewing()

    def _stop_renewing(self) -> None:
        if self._renewal_due is not None:
            self._renewal_due.cancel()
            self._renewal_due = None
        if self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None

    # -- the call ----------------------------------------------------------------------------

    async def call(self) -> Answer | None:
        """Make the call; None when the upstream refused it asking for a pause (the endpoint
        pauses, the task goes back to its place in line: wait again). Errors end the task."""
        self.call_started = started = time.monotonic()
        ep = self.endpoint
        if self.gone.done():  # left as it was admitted: nothing is called
            await self.finish("failed", CALLER_LOST, None, -1, None)
            raise CallerGone
        head, self._head = self._head, None  # built with the submit, for this call only
        try:
            if head is None:
                head = self.rt.http.relay_head(self.method, self.url, self._outgoing(), self.body)
            answer = await self._unless_gone(self.rt.http.relay(
                self.method, self.url, [], self.body, ep.timeout_ms / 1000, self._on_sent(),
                head))
        except secrets.Undecryptable as exc:
            # The caller learns no endpoint, header name or key id (as a queued task's owner
            # does not, app/queue/upstream.py); the operator reads them here.
            log.error("cannot open credentials: %s", exc, extra=self._extra())
            await self.finish("failed", CREDENTIALS_LOST, None, -1, None)
            raise ApiError(503, "credentials_unavailable", CREDENTIALS_LOST,
                           {"Retry-After": "5"}, task_id=self.task_id) from None
        except (OSError, BadAnswer, TimeoutError) as exc:
            # Before ValueError: a certificate the upstream fails to prove is both (ssl's
            # SSLCertVerificationError), and the upstream's fault, not the caller's request's.
            why = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            await self.finish("failed", f"upstream unreachable: {why}", None,
                              (time.monotonic() - started) * 1000, None)
            raise ApiError(502, "upstream_unreachable", f"the upstream did not answer: {why}",
                           task_id=self.task_id) from None
        except ValueError as exc:
            await self.finish("failed", f"request cannot be sent: {exc}", None, -1, None)
            raise ApiError(400, "invalid_request", str(exc)) from None
        pause = self._pause(answer)
        if pause is None:
            return answer
        assert answer.stream is not None
        answer.stream.close()
        await self._back_in_line(answer.status, pause, (time.monotonic() - started) * 1000)
        return None

    def _outgoing(self) -> list[tuple[str, str]]:
        """The upstream's headers: the endpoint's upstream_headers (the provider's key) replace
        any of the caller's; a copy either way (a call sent again after a pause must not carry
        two keys)."""
        headers = list(secrets.outgoing(self.headers, self.endpoint.credentials))
        if self.trace is not None:  # the upstream joins the trace under the proxy span
            headers = self.trace.outgoing(headers)
        headers.append(("Idempotency-Key", self.task_id))
        return headers

    def _prepare(self) -> None:
        """The call's head, built while Redis runs the submit and its own claim: for a call
        that follows them at once. One that waits in line builds it when it is admitted, from
        the endpoint as it is then (`_current`); so does one that cannot be built: `call`
        meets the error again where errors are handled (here, between the submit's write and
        its reply, nothing may raise)."""
        try:
            self._head = self.rt.http.relay_head(self.method, self.url, self._outgoing(),
                                                 self.body)
        except Exception:
            self._head = None

    def _on_sent(self) -> Callable[[], None] | None:
        """Under sliding windows: once the request has left, its admission's entries move to
        that moment (app/ratelimit/sent.py), so later admissions are checked against the calls
        the upstream really saw (event, read and connect took a while since the claim)."""
        ep, token, send_times = self.endpoint, self.token, self.rt.send_times
        logs = sliding_logs(self.keys, ep, token, self.spent)
        if not logs:
            return None
        admitted_at = self.admitted_at
        return lambda: send_times.sent(ep.id, token, admitted_at, logs)

    async def _unless_gone(self, opening: Awaitable[Answer]) -> Answer:
        """The answer's head, unless the caller leaves first (a slow upstream may take long
        before its first byte): the call is then aborted (the client closes its connection
        when cancelled) and the task ended. So too when the lease is lost meanwhile (a cancel
        by the owner or an operator freed the slot): the call must not run on outside the cap."""
        with Interrupt(self.gone, self.lease_lost) as stop:
            return await opening
        if stop.by is self.lease_lost:
            self._stop_renewing()
            self.token = ""  # the task is not ours to end any more
            raise ApiError(409, "task_cancelled", "the request's task was cancelled while its "
                           "call was on: the call was stopped", task_id=self.task_id)
        await self.finish("failed", CALLER_LOST, None,
                          (time.monotonic() - self.call_started) * 1000, None)
        raise CallerGone

    def _pause(self, answer: Answer) -> float | None:
        if answer.status not in (429, 503) or not self.endpoint.honor_upstream_limits:
            return None
        return pause_s(answer.status, answer.headers)

    async def _back_in_line(self, status: int, pause: float, exec_ms: float) -> None:
        """retry-8.lua: the endpoint pauses for what the upstream asked, the task waits it out
        set aside and then goes back to its place in line (its original score)."""
        self._stop_renewing()
        k, e, ep = self.keys, self.endpoint.id, self.endpoint
        limit_keys, spec = settle_limits(ep, k, self.rt.settings.rate_guard_ms)
        # ARGV[8..]: no refusal for free (the pause is its back-off), a real cost of 0 (it did
        # no work), the limits that settle.
        settle = [0, 0, *spec] if ep.max_cost is not None else []
        pause_ms = max(1, round(pause * 1000))
        log.info("upstream refused with a pause of %.2f s: back in line", pause,
                 extra=self._extra())
        await self.rt.queue.scripts.retry(
            keys=[k.active(e), k.task(self.task_id),
                  *k.of(e, "retry", "delayed", "queue", "wake", "stats", "probe"),
                  *(limit_keys if settle else []), *k.of(e, *starvation_keys(ep))],
            args=[self.task_id, self.token, pause_ms, e, pause_ms, status, round(exec_ms),
                  *settle])
        self.token = ""

    async def finish(self, status: str, text: str, code: int | None, exec_ms: float,
                     cost: int | None) -> bool:
        """ack-7.lua for this one task: completed or failed, its cost settled, its slot freed.
        False when the lease was no longer ours."""
        ending, _ = self.finishing(status, text, code, exec_ms, cost)
        return await ending

    def finishing(self, status: str, text: str, code: int | None, exec_ms: float,
                  cost: int | None, told: Mapping[str, str] | None = None
                  ) -> tuple[Awaitable[bool], bool]:
        """`finish`, started: the awaitable of its outcome, and whether its ack is written to
        Redis already (one Redis, a connection held): what this process sends next then
        reaches Redis's clients after it, without waiting for its reply. `told`: the answer's
        headers, whose rate-limit signals count as a dispatcher's answers' do."""
        self._stop_renewing()
        if not self.token:
            return _result(False), True
        calls, scripts, e = self.calls, self.rt.queue.scripts, self.endpoint.id
        pause_ms, left = self._signals(code, told)
        keys = [*calls.ack_keys, self.keys.task(self.task_id)]
        args = [e, "", 1, *calls.ack_limits, self.task_id, self.token, status, text,
                code or "", round(exec_ms), pause_ms, "" if cost is None else cost,
                ""]  # no result kept: the body went to its caller
        acking, written = scripts.ack.send(keys=keys, args=args)
        budget = None
        if left is not None:  # after the ack, which it counts the calls still on without
            # (on one Redis written right behind it; on a Cluster sent once the ack is back)
            budget, _ = scripts.budget.send(keys=list(self.keys.of(e, "stats", "active")),
                                            args=[left[0], round(left[1] * 1000)])
        sent = time.monotonic()

        def again() -> Awaitable[Any]:
            """The ack once more; the upstream's pause, if any, counted from the first."""
            if pause_ms:
                args[-3] = pause_left_ms(pause_ms, sent)  # 1 at least: the probe goes first
            return scripts.ack(keys=keys, args=args)

        return self._acked(acking, again, budget), written

    def _signals(self, code: int | None, told: Mapping[str, str] | None
                 ) -> tuple[int, tuple[int, float] | None]:
        """What an answer's headers ask of the whole endpoint, as app/queue/acks.py reads a
        dispatcher's answers: a pause (ms, 0 = none; a depleted `x-ratelimit-remaining-*`
        with its reset, on a 200 too) and how many more calls the upstream takes before its
        reset. Nothing when the endpoint does not honour upstream limits."""
        if told is None or code is None or not self.endpoint.honor_upstream_limits:
            return 0, None
        return asked_pause_ms(self.endpoint, pause_s(code, told), self.task_id), remaining(told)

    async def _told(self, budget: Awaitable[Any]) -> None:
        try:
            await budget
        except (RedisError, OSError) as exc:  # the upstream's next answer tells it again
            log.warning("could not keep the upstream's count: %s", exc, extra=self._extra())

    async def _acked(self, acking: Awaitable[Any], again: Callable[[], Awaitable[Any]],
                     budget: Awaitable[Any] | None = None) -> bool:
        """The ack's first try. One that Redis fails (an outage, a failover) is sent again in
        the background until it lands or the lease would lapse, as a dispatcher's acks are:
        the caller has its answer (or its 502 now), and the task must not end `failed`
        ("caller connection lost") for a Redis that was away meanwhile. Sent twice it is
        harmless: the second finds its token released by the first. The upstream's count
        (`budget`) follows the ack, within this outcome (as the ack, it must be in before the
        caller's next call: on a Cluster, awaited before the last bytes); in the background
        when the ack failed or was cancelled."""
        try:
            res = await acking
        except BaseException as exc:
            if budget is not None:
                self.rt.afterwards(self._told(budget))
            if not isinstance(exc, RedisError | OSError):
                raise
            window = self.lease_until - time.monotonic()
            if window > 0:
                self.rt.afterwards(self._ack_again(again, window, exc))
            else:
                log.warning("could not finish the task: %s; its lease will lapse", exc,
                            extra=self._extra())
            return False
        if budget is not None:
            await self._told(budget)
        self.token = ""
        return bool(int(res[1]))

    async def _ack_again(self, again: Callable[[], Awaitable[Any]], window: float,
                         exc: BaseException) -> None:
        if await persist("proxied call's ack", again, window) is None:
            log.warning("could not finish the task: %s; its lease will lapse", exc,
                        extra=self._extra())
        else:
            self.token = ""

    def _extra(self) -> dict[str, str]:
        return {"task_id": self.task_id, "endpoint": self.endpoint.id}


async def _result(value: bool) -> bool:
    return value


def _too_long(max_wait_s: float, estimate: Any, task_id: str) -> ApiError:
    retry = max(1, math.ceil(float(estimate))) if estimate is not None else max(
        1, math.ceil(max_wait_s))
    # Not "did not reach the upstream": one the upstream kept asking to wait (429s with a
    # pause, each sending it back in line) did reach it.
    return ApiError(503, "wait_exceeded", f"the request was not served within its max wait "
                    f"of {max_wait_s:g} s", {"Retry-After": str(retry)}, wait_time=retry,
                    task_id=task_id)
