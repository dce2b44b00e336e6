"""A claimed task as the dispatcher runs it, and what its ending tells the scripts."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.core.keys import Keys
from app.endpoints import EndpointConfig
from app.queue.fairness import starvation_keys
from app.queue.upstream import Outcome, Request
from app.ratelimit import Limit, further_limits
from app.ratelimit.sent import SendTimes, sliding_logs

log = logging.getLogger(__name__)
CLAIM_FIELDS = 10  # values per claimed task in claim-12.lua's answer
FREE_REFUSALS = 20  # refusals with a pause a task may have without spending attempts


@dataclass
class Claim:
    endpoint: EndpointConfig
    task_id: str
    token: str
    attempts: int
    ttype: str
    request: Request
    claimed_at: float = 0.0  # loop time the claim was asked for (its admissions came after)
    cost: int = 1  # what its admission spent of per-cost limits

    def on_sent(self, send_times: SendTimes) -> Callable[[], None] | None:
        """For the call right after the claim, under sliding windows: keep its log entries
        (named by the lease token) to when the call really leaves."""
        ep = self.endpoint
        logs = sliding_logs(send_times.keys, ep, self.token, self.cost)
        if not logs:
            return None
        fired = False

        def sent() -> None:  # once: a request is sent again when its kept-alive connection was dead
            nonlocal fired
            if not fired:
                fired = True
                send_times.sent(ep.id, self.token, self.claimed_at, logs)
        return sent



def limit_keys(keys: Keys, endpoint: EndpointConfig) -> list[str]:
    """The further limits' state and pace keys, two a limit in the order further_limits passes
    the limits: the KEYS claim-12.lua, ack-7.lua and retry-8.lua take after their fixed ones."""
    e = endpoint.id
    return [key for x in endpoint.limits for key in (
        keys.further_limit(e, x.limiter, x.per, x.rate, x.interval_ms),
        keys.further_pace(e, x.limiter, x.per, x.rate, x.interval_ms))]


def claim_keys(keys: Keys, endpoint: EndpointConfig) -> list[str]:
    """claim-12.lua's KEYS (the limiter's depend on the endpoint's current limits)."""
    e, kind = endpoint.id, endpoint.limiter
    return [*keys.of(e, "queue", "active"), keys.ratelimit(e, kind),
            *keys.of(e, "wake", "delayed", "retry", "stats", "deadlines", "probe", "outbox",
                     "hooks"),
            keys.pace(e, kind, endpoint.rate, endpoint.interval_ms), *limit_keys(keys, endpoint),
            *keys.of(e, *starvation_keys(endpoint), *cost_keys(endpoint))]


def claim_args(keys: Keys, endpoint: EndpointConfig, room: int, token_prefix: str,
               lease_ms: int, guard_ms: int, only: str = "") -> list[Any]:
    """claim-12.lua's ARGV for up to `room` tasks of this endpoint; with `only`, that one task
    if it is the first the rules would claim (room 1: a proxied request's API process)."""
    return [endpoint.id, room, endpoint.max_concurrency, lease_ms, endpoint.limiter,
            endpoint.rate, endpoint.interval_ms, keys.task_prefix(endpoint.id), token_prefix,
            endpoint.permit_ttl_s * 1000, Limit.of(endpoint, guard_ms).guard_ms,
            *admission_args(endpoint, guard_ms), only]


def reads_costs(endpoint: EndpointConfig) -> bool:
    """Whether per-cost admissions reserve at least the caller's recent real cost."""
    return bool(endpoint.limits and endpoint.cost_from and endpoint.max_cost is not None)


def cost_keys(endpoint: EndpointConfig) -> tuple[str, ...]:
    """The callers' real costs (Keys.real_costs), for a claim that reads them (last of its
    KEYS)."""
    return ("real_costs",) if reads_costs(endpoint) else ()


def admission_args(endpoint: EndpointConfig, guard_ms: int) -> list[str | int]:
    """claim-12.lua's ARGV[12..]: the further limits (a count of 0 when none), then the
    starvation bound (ms, 0 = none), then the adaptive endpoint's least cap (0 = fixed), then
    '1' when per-cost admissions reserve at least the caller's recent real cost (cost_from),
    then '0' when the upstream's pauses and budgets hold nothing (honor_upstream_limits off)."""
    return [*(further_limits(endpoint, guard_ms) or [0]),
            (endpoint.max_starvation_s or 0) * 1000,
            endpoint.min_concurrency if endpoint.concurrency == "adaptive" else 0,
            "1" if reads_costs(endpoint) else "0",
            "1" if endpoint.honor_upstream_limits else "0"]


def settle_limits(endpoint: EndpointConfig, keys: Keys, guard_ms: int
                  ) -> tuple[list[str], list[str | int]]:
    """The limits a call's real cost settles, as ack-7.lua and retry-8.lua take them: their
    state keys, then their count and specs (further_limits); none (a count of 0) when the
    endpoint has no per-cost limit."""
    if endpoint.max_cost is None:
        return [], [0]
    return limit_keys(keys, endpoint), further_limits(endpoint, guard_ms)


def ack_cost_keys(endpoint: EndpointConfig, keys: Keys, limits: list[str]) -> list[str]:
    """ack-7.lua's key after the limits' (`limits`, settle_limits's): the callers' real costs,
    which its acks update, when limits settle."""
    return [keys.real_costs(endpoint.id)] if limits else []


def real_cost(claim: Claim, outcome: Outcome) -> int | None:
    """What a call spent of per-cost limits (None: unknown, nothing settles). A call the
    upstream refused with a pause (429/503 with Retry-After or its reset) spent nothing
    there: it settles to 0, or each refused attempt would spend the budget its retry reserves
    again. A figure above a limit's whole rate is charged as that rate (lim_settle), one
    interval of it: a misread `x-usage: 1000000000000` must not pace the endpoint for
    centuries; the operator is told, since the upstream's figure or cost_from is wrong."""
    if refused(outcome):
        return 0
    cost, rates = outcome.cost, [x.rate for x in claim.endpoint.limits if x.per == "cost"]
    if cost is not None and rates and cost > min(rates):
        log.warning("the upstream reported a cost of %d, over the limit's whole rate (%d per "
                    "interval): charged as that rate", cost, min(rates),
                    extra={"task_id": claim.task_id, "endpoint": claim.endpoint.id})
    return cost


def settle_args(claim: Claim, outcome: Outcome, keys: Keys, guard_ms: int
                ) -> tuple[list[str], list[str | int]]:
    """retry-8.lua's KEYS[9..] and ARGV[8..]: the refusals a task may have for free, then the
    limits' state keys, the real cost and the limits it settles; no cost nor limits when there
    is nothing to settle (no per-cost limit, or no real cost read)."""
    cost = real_cost(claim, outcome)
    free = FREE_REFUSALS if given_back(claim, outcome) else 0
    if cost is None or claim.endpoint.max_cost is None:
        return [], [free]
    limits, spec = settle_limits(claim.endpoint, keys, guard_ms)
    return limits, [free, cost, *spec]


def given_back(claim: Claim, outcome: Outcome) -> bool:
    """A refusal that costs the task nothing (retry-8.lua): back to its place in line, the
    endpoint's pause holding it, its attempt not spent. Only when the pause is honoured (else
    nothing would hold it), and a task refused FREE_REFUSALS times spends attempts again, so an
    upstream that refuses one task for ever (a request over a token limit) still ends it."""
    return refused(outcome) and claim.endpoint.honor_upstream_limits


def refused(outcome: Outcome) -> bool:
    """The upstream turned the call away, asking for a pause: it did no work for it."""
    return outcome.status_code in (429, 503) and outcome.pause_s is not None


def pause_ms(claim: Claim, outcome: Outcome) -> int:
    """The pause the upstream asked of the whole endpoint (0 = none, or not honoured)."""
    return asked_pause_ms(claim.endpoint, outcome.pause_s, claim.task_id)


def pause_left_ms(pause: int, since: float) -> int:
    """`pause` (ms, 0 = none), asked for by an answer read at monotonic time `since`, as what
    is left of it now: an ack retried through a Redis outage must not start the upstream's
    pause again from its late try. 1 at least: the probe still goes first."""
    if not pause:
        return 0
    return max(1, pause - round((time.monotonic() - since) * 1000))


def asked_pause_ms(endpoint: EndpointConfig, pause_s: float | None, task_id: str) -> int:
    """`pause_s` (signals.pause_s of an answer) as ack-7.lua takes it: ms, 0 = none or not
    honoured by the endpoint (a dispatcher's answers and a proxied call's alike)."""
    if pause_s is None or not endpoint.honor_upstream_limits:
        return 0
    if pause_s:
        log.warning("upstream asks for a pause of %.1f s", pause_s,
                    extra={"task_id": task_id, "endpoint": endpoint.id})
    return max(1, round(pause_s * 1000))
