"""The endpoint config (one business API behind the gateway) and URL matching."""

from __future__ import annotations

import re
from functools import cached_property
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    ConfigDict,
    Field,
    SerializationInfo,
    StringConstraints,
    field_serializer,
    field_validator,
    model_validator,
)

from app.errors import expects
from app.models import ENDPOINT_ID, HTTP_URL, Method, StrictInput
from app.secrets import AS_IS, Credentials, mask

Limiter = Literal["sliding_window", "fixed_window", "token_bucket"]
MAX_LIMITS = 5
#: Where a finished call's real cost is read: a response header, or a dot path in its JSON body.
#: A proxied stream's cost is read from its events: 'sse:<dot.path>', paths joined by '+' added up.
_SSE_PATH = r"[^\s.+]{1,64}(\.[^\s.+]{1,64}){0,7}"
COST_FROM = expects(
    r"^(header:[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}|json:[^\s.]{1,64}(\.[^\s.]{1,64}){0,7}"
    rf"|sse:{_SSE_PATH}(\+{_SSE_PATH}){{0,3}})$",
    "'header:<name>', 'json:<dot.path>' or 'sse:<dot.path>[+<dot.path>]' (up to 8 parts a path)")


def _post_only() -> list[Method]:
    return ["POST"]


def url_key(url: str) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, path) of an http(s) URL; None if it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname or port == 0:
        return None  # port 0 is nowhere to call (taken as the default, every call failed)
    port = port or (443 if scheme == "https" else 80)
    return scheme, parts.hostname.lower(), port, parts.path or "/"


#: Request headers a task's call carries by default; an endpoint adds to them (forward_headers).
#: Everything else a caller put in `headers` stays behind: credentials, identities
#: (X-Remote-User, X-Client-IP ...) and overrides (X-HTTP-Method-Override) an upstream might
#: believe because they seem to come from a trusted gateway.
DEFAULT_FORWARD = frozenset({
    "accept", "accept-language", "content-type", "content-language", "user-agent",
    "traceparent", "tracestate", "baggage",
})
#: Never forwarded, even when listed: they describe the gateway's own connection and request.
_NEVER_FORWARD = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer",
    "upgrade", "expect", "proxy-authorization", "proxy-connection", "idempotency-key",
    "accept-encoding",  # the gateway decodes what it asked for (gzip, deflate), nothing else
})
# An RFC 9110 field name.
HEADER_NAME = re.compile(expects(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$",
                                 "an HTTP header name (1 to 128 token characters)"))
#: Control characters an HTTP field value cannot hold (CR and LF would split the request).
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
MAX_UPSTREAM_HEADERS = 32


#: Its length is checked by `_settable` (HEADER_NAME), which never echoes a name: a bound here
#: would have pydantic print the whole name, which may hold the value, in the error.
HeaderNameText = str
#: Long enough for a sealed value of MAX_VALUE_BYTES (app/secrets.py checks the plain one).
HeaderValueText = Annotated[str, StringConstraints(min_length=1, max_length=6000)]
TargetUrl = Annotated[
    str, StringConstraints(max_length=2048, pattern=expects(
        HTTP_URL + r"(/[^?#\x00-\x20\x7f-\x9f]*)?$",
        "an absolute http:// or https:// URL with a host and a path, no query or fragment"))]


class LimitSpec(StrictInput):
    """A further limit enforced with the endpoint's main one, in the same atomic claim."""

    model_config = ConfigDict(extra="forbid", strict=True)

    limiter: Limiter = "sliding_window"
    rate: int = Field(ge=1, le=1_000_000_000, description="admissions (or cost units) per interval")
    interval_ms: int = Field(1000, ge=1, le=86_400_000)
    per: Literal["request", "cost"] = Field(
        "request", description="'cost': each task spends its `cost` (estimated at submit, "
                               "settled to the real cost read through cost_from)")


class EndpointSettings(StrictInput):
    """Everything about an endpoint but its id: the body of PUT, and of PATCH with fields unset."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, StringConstraints(max_length=200)] = ""
    target_url: TargetUrl
    methods: list[Method] = Field(default_factory=_post_only, min_length=1)
    limiter: Limiter = "sliding_window"
    rate: int = Field(0, ge=0, le=1_000_000, description="admissions per interval; 0 = unlimited")
    interval_ms: int = Field(1000, ge=1, le=86_400_000)
    max_concurrency: int = Field(0, ge=0, le=100_000, description="0 = unlimited; adaptive: "
                                                                  "the most it may learn")
    concurrency: Literal["fixed", "adaptive"] = Field(
        "fixed", description="adaptive: the cap follows the upstream's latency and refusals, "
                             "between min_concurrency and max_concurrency, learnt in Redis by "
                             "every dispatcher")
    min_concurrency: int = Field(1, ge=1, le=100_000, description="adaptive: the least cap")
    avg_exec_ms: int = Field(1000, ge=1, le=86_400_000)
    timeout_ms: int = Field(30_000, ge=1, le=3_600_000)
    max_retries: int = Field(3, ge=0, le=100)
    retry_backoff_ms: int = Field(1000, ge=0, le=3_600_000)
    max_queue_len: int = Field(100_000, ge=0, le=100_000_000, description="0 = unbounded")
    permit_ttl_s: int = Field(20, ge=1, le=86_400)
    permit_max_uses: int = Field(3, ge=1, le=1_000_000)
    enabled: bool = True
    honor_upstream_limits: bool = Field(
        True, description="a 429/503 with Retry-After, or x-ratelimit-remaining-*: 0 with its "
                          "reset, pauses the endpoint on every dispatcher until then; one probe "
                          "call reopens it")
    forward_headers: list[Annotated[str, StringConstraints(max_length=128,
                                                           pattern=HEADER_NAME.pattern)]] = Field(
        default_factory=list, max_length=64,
        description="request headers a task may carry to this endpoint besides Accept, "
                    "Accept-Language, Content-Type, Content-Language, User-Agent and trace "
                    "context (traceparent, tracestate, baggage); names, case-insensitive")
    paused: bool = Field(False, description="stop dispatching; submits are still accepted")
    fairness: Literal["fifo", "per_user", "weighted"] = Field(
        "fifo", description="per_user: users with tasks waiting at the same priority take "
                            "turns, one task each a round; weighted: as many a round as "
                            "their key's tier weighs (PUT /admin/v1/tiers/{tier}); fifo: "
                            "arrival order")
    max_starvation_s: int | None = Field(
        None, ge=1, le=86_400, description="a task waiting longer than this is served before "
                                           "higher priorities; none: strict priority")
    limits: list[LimitSpec] = Field(
        default_factory=list, max_length=MAX_LIMITS,
        description="further limits enforced together with the main one (e.g. 3/s and 100/min "
                    "and 2000/day, or 90,000 cost units a minute)")
    cost_from: Annotated[str, StringConstraints(max_length=200, pattern=COST_FROM)] | None = Field(
        None, description="where a finished call's real cost is read to settle its per-cost "
                          "reservations: 'header:<name>' or 'json:<dot.path>' of the response, "
                          "or 'sse:<dot.path>' of a stream's last data: event that has it "
                          "(paths joined by '+' are added up)")
    proxy: bool = Field(False, description="open to the drop-in proxy: ANY "
                                           "/proxy/{id}/{path} calls target_url + path")
    upstream_headers: dict[HeaderNameText, HeaderValueText] = Field(
        default_factory=dict, max_length=MAX_UPSTREAM_HEADERS, repr=False,
        description="headers sent on every call to this endpoint, e.g. the provider's "
                    "Authorization; never taken from a caller (a caller's header of the same "
                    "name is dropped). Write-only: answers show each value as \"<set>\", and "
                    "\"<set>\" sent back keeps the stored value. Stored encrypted")

    @field_validator("limits")
    @classmethod
    def _distinct(cls, v: list[LimitSpec]) -> list[LimitSpec]:
        # Two equal limits would share one state key (keyed by what they limit) and count
        # twice; one of them says all they say, so the repeats go.
        seen: set[tuple[str, int, int, str]] = set()
        out = []
        for x in v:
            if (key := (x.limiter, x.rate, x.interval_ms, x.per)) not in seen:
                seen.add(key)
                out.append(x)
        return out

    @field_validator("methods", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        if isinstance(v, list):
            return [m.upper() if isinstance(m, str) else m for m in v]
        return v

    @field_validator("forward_headers")
    @classmethod
    def _header_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a header name")
            if name.lower() in _NEVER_FORWARD or name.lower().startswith(("x-queue-", "proxy-")):
                raise ValueError(f"{name} is the gateway's own and is never forwarded")
        return v

    @field_validator("upstream_headers")
    @classmethod
    def _settable(cls, v: dict[str, str]) -> dict[str, str]:
        seen: set[str] = set()
        for name, value in v.items():
            if not HEADER_NAME.match(name):  # not echoed: a mistake may hold the value
                raise ValueError("a name is not a header name: over 128 characters, or "
                                 "holding characters one cannot (a space, ':' ...); give "
                                 "names and values apart")
            low = name.lower()
            if low in _NEVER_FORWARD or low.startswith(("x-queue-", "proxy-")):
                raise ValueError(f"{name} is the gateway's own and cannot be set")
            if low in seen:
                raise ValueError(f"{name} is given twice (names are case-insensitive)")
            seen.add(low)
            if _BAD_VALUE.search(value):
                raise ValueError(f"the value of {name} holds a control character (CR, LF, "
                                 "NUL ...)")
        return v

    @field_serializer("upstream_headers")
    def _masked(self, v: dict[str, str], info: SerializationInfo) -> dict[str, str]:
        # Masked unless the caller asks for them as held (the stores: sealed values).
        if info.context == AS_IS:
            return dict(v)
        return mask(v)

    @field_validator("target_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is None:  # PATCH leaves it as it is
            return v
        if url_key(v) is None:
            raise ValueError("target_url must be an absolute http:// or https:// URL")
        if urlsplit(v).query or urlsplit(v).fragment:
            raise ValueError("target_url must not carry a query string or fragment")
        return v


class EndpointConfig(EndpointSettings):
    id: Annotated[str, StringConstraints(pattern=ENDPOINT_ID)]

    @model_validator(mode="after")
    def _adaptive_bounds(self) -> EndpointConfig:
        # Checked on the whole endpoint (a PATCH may set one bound and keep the other).
        if self.concurrency == "adaptive" and not (
                0 < self.min_concurrency <= self.max_concurrency):
            raise ValueError("concurrency adaptive needs max_concurrency of at least "
                             "min_concurrency")
        return self

    @property
    def key(self) -> tuple[str, str, int, str]:
        key = url_key(self.target_url)
        assert key is not None  # validated
        return key

    @cached_property
    def forwarded(self) -> frozenset[str]:
        """Lower-case names of the request headers its calls carry."""
        return DEFAULT_FORWARD | {name.lower() for name in self.forward_headers}

    @cached_property
    def credentials(self) -> Credentials | None:
        """Its upstream_headers for its calls (sealed: opened by app/secrets.py at call time)."""
        if not self.upstream_headers:
            return None
        return Credentials(self.id, tuple(self.upstream_headers.items()))

    @cached_property
    def max_cost(self) -> int | None:
        """The largest cost a task may have: the smallest rate of its per-cost limits (a task
        costing more could never be admitted); None when it has none."""
        rates = [x.rate for x in self.limits if x.per == "cost"]
        return min(rates) if rates else None

    def call_url(self, task_url: str) -> str:
        """Where a task's call goes: this endpoint's URL as registered now, with the query the
        caller gave; nothing else of the caller's URL string (its host, credentials) counts."""
        if "?" not in task_url:
            return self.target_url
        query = urlsplit(task_url).query
        return f"{self.target_url}?{query}" if query else self.target_url


class EndpointPatch(EndpointSettings):
    """PATCH (and `qgw endpoints update`): every field optional; the merged result is
    validated in full."""

    target_url: TargetUrl | None = None  # type: ignore[assignment]
