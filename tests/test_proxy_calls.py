"""The proxy's script calls built once per endpoint version (app/proxy/calls.py) are the calls
the per-request builders make: same KEYS, same ARGV, for endpoints with and without further
limits, starvation bounds and real costs; an edited endpoint (a new version) gets its own."""

from __future__ import annotations

from typing import Any

import pytest

from app.core.keys import Keys
from app.endpoints import EndpointConfig
from app.proxy.calls import endpoint_calls
from app.queue.acks import ACK_KEYS
from app.queue.claims import ack_cost_keys, claim_args, claim_keys, settle_limits

COST = {"limiter": "sliding_window", "rate": 10, "interval_ms": 2000, "per": "cost"}
SHAPES: list[dict[str, Any]] = [
    {},
    {"rate": 5, "interval_ms": 1000, "max_concurrency": 3},
    {"rate": 5, "limits": [COST], "cost_from": "header:x-cost", "max_starvation_s": 30},
    {"concurrency": "adaptive", "min_concurrency": 2, "max_concurrency": 8,
     "limiter": "token_bucket", "rate": 7},
]


def endpoint(**fields: Any) -> EndpointConfig:
    return EndpointConfig.model_validate(
        {"id": "llm", "target_url": "http://127.0.0.1:9/v1", "proxy": True, **fields},
        strict=False)


@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("fields", SHAPES)
def test_built_once_as_built_per_request(fields: dict[str, Any], cluster: bool) -> None:
    keys, ep = Keys(cluster=cluster), endpoint(**fields)
    calls = endpoint_calls(keys, ep, 3000, 20)
    assert calls.claim_keys == claim_keys(keys, ep)
    assert calls.claim_argv("proxy.ab", "t1.llm") == claim_args(
        keys, ep, 1, "proxy.ab", 3000, 20, only="t1.llm")
    limit_keys, limits = settle_limits(ep, keys, 20)
    assert list(calls.ack_keys) == [*keys.of("llm", *ACK_KEYS), *limit_keys,
                                    *ack_cost_keys(ep, keys, limit_keys)]
    assert list(calls.ack_limits) == limits
    assert endpoint_calls(keys, ep, 3000, 20) is calls  # built once


def test_an_edited_endpoint_is_built_afresh() -> None:
    keys = Keys()
    before = endpoint_calls(keys, endpoint(rate=5), 3000, 20)
    after = endpoint_calls(keys, endpoint(rate=9), 3000, 20)  # an edit: a new version
    assert after is not before
    assert after.claim_argv("p", "t")[5] == 9 and before.claim_argv("p", "t")[5] == 5
    assert endpoint_calls(keys, endpoint(rate=9), 4000, 20).lease_ms == 4000
