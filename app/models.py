"""The task model and the JSON shapes of the public API (field names of the go-zero service)."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    field_validator,
)

from app.errors import expects
from app.webhooks import registrable

MAX_PRIORITY = 1000  # keeps every queue score below 2^53 (see lua/submit-5.lua)
ENDPOINT_ID = expects(r"^[a-z0-9][a-z0-9_-]{0,63}$", "1 to 64 lowercase letters, digits, "
                      "'_' or '-', starting with a letter or digit")
_PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
CALLBACK_PREFIX = expects(
    rf"^https?://[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*(:{_PORT})?(/[A-Za-z0-9_~-][A-Za-z0-9._~-]*)*/?$",
    "an http:// or https:// URL prefix: a host name, an optional port, a path without "
    "'..', no query")
CallbackPrefix = Annotated[str, StringConstraints(max_length=2048, pattern=CALLBACK_PREFIX)]
# scheme://host[:port] with an unambiguous host; the rest (path, query) is checked by the caller.
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
HTTP_URL = expects(r"^[hH][tT][tT][pP][sS]?://[A-Za-z0-9._~%-]+(:" + _PORT + ")?",
                   "an absolute http:// or https:// URL with a host (and a port up to 65535)")
Method = Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class TaskStatus(enum.StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def finished(self) -> bool:
        return self not in (TaskStatus.PENDING, TaskStatus.PROCESSING)


class TaskType(enum.StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"
    PROXY = "proxy"  # a drop-in proxy's request (app/proxy/): its caller's process calls


MultiDict = dict[Annotated[str, StringConstraints(max_length=256)], list[str]]


class StrictInput(BaseModel):
    """Strict JSON input: no strings for numbers, no numbers for booleans.

    A whole float still counts as an integer (JSON Schema's rule); app.routes.body.parse
    handles that on the error path, so the fast JSON path stays fast.
    """

    model_config = ConfigDict(strict=True)


class SubmitRequest(StrictInput):
    model_config = ConfigDict(extra="ignore", strict=True)

    # The pattern is in the schema too, so clients (and the fuzzer) know what is accepted.
    target_url: Annotated[str, StringConstraints(max_length=2048, pattern=HTTP_URL)]
    http_method: Method = "POST"
    body: str = Field("", description="request body for the business API, as a string")
    priority: int = Field(0, ge=0, le=MAX_PRIORITY)
    timestamp: int | None = Field(None, description="client clock (ms); informative only")
    # A Literal, not the enum, keeps the OpenAPI schema of this body free of $refs.
    task_type: Literal["online", "offline"] = "offline"
    max_wait_s: int | None = Field(
        None, gt=0, le=30 * 86_400,
        description="start within this many seconds or not at all: 409 deadline_unreachable "
                    "when the estimate already exceeds it (409 endpoint_paused while an "
                    "operator has paused the endpoint: its wait is unknown), else the task "
                    "expires unstarted")
    # Header names are checked when the call is made (invalid ones are dropped), not here:
    # JSON Schema cannot state a pattern for keys in a way every client honours.
    headers: MultiDict = Field(default_factory=dict)
    query_params: MultiDict = Field(default_factory=dict)
    #: POSTed the status once the task ends; must lie under one of the key's callback_urls.
    callback_url: Annotated[str, StringConstraints(max_length=2048)] | None = None
    cost: int = Field(1, ge=1, le=10**9, description="what the call spends of the endpoint's "
                      "per-cost limits (e.g. estimated tokens); settled to the real cost")

    @field_validator("http_method", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v



class ApiKeyCreate(StrictInput):
    """The body of POST /admin/v1/api-keys, and `qgw keys create`'s options."""

    model_config = ConfigDict(extra="forbid", strict=True)
    user_id: int = Field(ge=0, le=2**53, description="up to 2^53: exact in every JSON parser")
    tier: str = Field("standard", min_length=1, max_length=32)
    max_priority: int = Field(0, ge=0, le=MAX_PRIORITY)
    daily_quota: int = Field(0, ge=0, le=2**31 - 1, description="0 = unlimited")
    # The pattern says in the OpenAPI document what `registrable` accepts: http(s), a host, an
    # optional port, path segments not starting with a dot; no userinfo, query or fragment.
    callback_urls: list[CallbackPrefix] = Field(
        default_factory=list, max_length=20,
        description="URL prefixes this key's tasks may name as callback_url")

    @field_validator("callback_urls")
    @classmethod
    def _registrable(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if why := registrable(url):
                raise ValueError(f"callback URL {url!r} {why}")
        return urls


WAIT_TIME = ("estimated whole seconds until the task starts, rounded up; null (unknown) while "
             "its endpoint is paused by its operator")


class SubmitResponse(BaseModel):
    task_id: str
    task_status: TaskStatus
    created_at: str | None
    wait_num: int
    wait_time: int | None = Field(0, description=WAIT_TIME)


class Permit(BaseModel):
    token: str
    expires_at: str


class TaskView(BaseModel):
    task_id: str
    task_type: TaskType
    task_status: TaskStatus
    task_result: str | None = None
    wait_num: int = 0
    wait_time: int | None = Field(0, description=WAIT_TIME)  # go-zero clients: int64
    created_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    result_status_code: int | None = None
    attempts: int = 0
    permit: Permit | None = None
    #: None: `task_result` is the text itself; "base64": the bytes in base64; "external":
    #: too large to inline (`task_result` is null), read it at GET /api/v1/tasks/{id}/result.
    result_encoding: Literal["base64", "external"] | None = None
    result_content_type: str | None = None  # the upstream's Content-Type
    result_bytes: int | None = None  # the body's size in bytes (set once the task finished)
    #: Not in the answer: a read with a result limit left a longer inline result out
    #: (app/routes/large.py serves those from an encoded copy).
    _left_out: bool = PrivateAttr(False)

    @property
    def result_left_out(self) -> bool:
        return self._left_out


class CancelResponse(BaseModel):
    task_id: str
    task_status: TaskStatus


class CompleteRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    task_result: str | None = None


class ErrorBody(BaseModel):
    code: str
    message: str
    task_status: TaskStatus | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
