"""A proxied request's script calls for one endpoint: claim-12.lua's and ack-7.lua's KEYS and
their ARGV but the request's own values, built once per version of the endpoint rather than
on every request (they were a tenth of the request's CPU before its submit went out)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.core.keys import Keys
from app.endpoints import EndpointConfig
from app.queue.acks import ACK_KEYS
from app.queue.claims import ack_cost_keys, claim_args, claim_keys, settle_limits

#: Endpoint versions kept; past this the cache starts again (versions replaced by edits are
#: never asked for again, so they must not pile up).
MAX_KEPT = 1024
_TOKEN, _ONLY = "\0token", "\0only"  # stand-ins in the template, replaced per request


@dataclass(frozen=True, slots=True)
class EndpointCalls:
    endpoint: EndpointConfig  # the version these were built from (the cache checks identity)
    keys: Keys
    lease_ms: int
    guard_ms: int
    claim_keys: list[str]
    claim_head: tuple[Any, ...]  # ARGV before the lease token prefix
    claim_tail: tuple[Any, ...]  # ARGV after it, but `only`
    ack_keys: tuple[str, ...]  # KEYS but the task's hash
    ack_limits: tuple[Any, ...]  # the limits its cost settles (ARGV[4..])

    def claim_argv(self, token_prefix: str, task_id: str) -> list[Any]:
        """claim-12.lua's ARGV claiming `task_id` alone, if it is first in line (`only`)."""
        return [*self.claim_head, token_prefix, *self.claim_tail, task_id]


_built: dict[int, EndpointCalls] = {}


def endpoint_calls(keys: Keys, endpoint: EndpointConfig, lease_ms: int,
                   guard_ms: int) -> EndpointCalls:
    found = _built.get(id(endpoint))
    if found is not None and found.endpoint is endpoint and found.keys is keys \
            and found.lease_ms == lease_ms and found.guard_ms == guard_ms:
        return found
    argv = claim_args(keys, endpoint, 1, _TOKEN, lease_ms, guard_ms, only=_ONLY)
    cut = argv.index(_TOKEN)
    assert argv[-1] == _ONLY
    limit_keys, limits = settle_limits(endpoint, keys, guard_ms)
    calls = EndpointCalls(
        endpoint, keys, lease_ms, guard_ms, claim_keys(keys, endpoint), tuple(argv[:cut]),
        tuple(argv[cut + 1:-1]),
        (*keys.of(endpoint.id, *ACK_KEYS), *limit_keys, *ack_cost_keys(endpoint, keys, limit_keys)),
        tuple(limits))
    if len(_built) >= MAX_KEPT:
        _built.clear()
    _built[id(endpoint)] = calls
    return calls
