"""A claimed task as the dispatcher runs it, and what its ending tells the scripts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from app.endpoints import EndpointConfig
from app.queue.upstream import Outcome, Request
from app.ratelimit import further_limits
from app.ratelimit.sent import SendTimes, sliding_logs

log = logging.getLogger(__name__)


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

        def sent() -> None:  # once: aiohttp sends again when a kept-alive connection was dead
            nonlocal fired
            if not fired:
                fired = True
                send_times.sent(ep.id, self.token, self.claimed_at, logs)
        return sent



def settle_args(claim: Claim, outcome: Outcome, guard_ms: int) -> list[str | int]:
    """ack-5.lua's ARGV[10..]: the real cost and the limits it settles; nothing when there is
    nothing to settle (no per-cost limit, or no real cost read)."""
    if outcome.cost is None or claim.endpoint.max_cost is None:
        return []
    return [outcome.cost, *further_limits(claim.endpoint, guard_ms)]


def pause_ms(claim: Claim, outcome: Outcome) -> int:
    """The pause the upstream asked of the whole endpoint (0 = none, or not honoured)."""
    if outcome.pause_s is None or not claim.endpoint.honor_upstream_limits:
        return 0
    if outcome.pause_s:
        log.warning("upstream asks for a pause of %.1f s", outcome.pause_s,
                    extra={"task_id": claim.task_id, "endpoint": claim.endpoint.id})
    return max(1, round(outcome.pause_s * 1000))
