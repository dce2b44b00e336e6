"""Settings from the environment (`QGW_*`), an optional `.env`, and CLI flags."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app import logs
from app.redis_url import parse as parse_redis_url
from app.secrets import Keyring, new_key, parse_key

#: The largest answer kept in a task: its base64 (14,666,668 characters) fits a MEDIUMTEXT
#: (16,777,215 bytes) and, with the rest of its row (a dead letter's kept request, escaped
#: twice at worst), MySQL's default max_allowed_packet (16 MiB). At 12 MiB the base64
#: overflowed both: the server cut the outbox writer's connection on every try, and no later
#: task of the endpoint reached SQL.
MAX_INLINE_BYTES = 11_000_000


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QGW_", env_file=".env", extra="ignore")

    #: redis://, rediss://, unix://, redis+sentinel://, redis+cluster:// (docs/api.md); unset: a
    #: private Redis-compatible server on a unix socket in the data dir, append-only file on.
    redis_url: str | None = None
    #: sqlite+aiosqlite:// or mysql+aiomysql://user:pw@host:3306/db; unset: SQLite in the data dir.
    database_url: str | None = None
    #: How long a request waits for the database (status of a finished task, admin writes)
    #: before it is answered 503 database_unavailable instead of held by a database that
    #: stopped answering. Background jobs get 30 s a batch.
    sql_timeout_s: float = Field(3.0, gt=0, le=60)
    #: The embedded Redis's data, the SQLite file, the generated admin token and permit secret.
    data_dir: Path = Path(".qgw")
    #: Listen address of `qgw serve` and `qgw api` (their --host).
    host: str = "127.0.0.1"
    #: Listen port (--port).
    port: int = Field(8080, ge=0, le=65535)
    #: At least 16 characters: the admin API must not be guessable (unset: one is generated).
    admin_token: str | None = Field(None, min_length=16)
    #: HMAC key of online permits, the same on every replica (unset: generated into the data dir).
    permit_secret: str | None = None
    #: Seals endpoints' upstream_headers (AES-256-GCM): 32 bytes as 64 hex digits or base64
    #: (unset: one is generated into the data dir, file `secrets_key`). Every process of one
    #: gateway needs the same key.
    secrets_key: str | None = Field(None, repr=False)
    #: The key before a rotation: values it sealed still open until `qgw secrets rotate`.
    secrets_key_previous: str | None = Field(None, repr=False)
    #: Prefix of every Redis key: gateways sharing one Redis (or a Cluster) need their own.
    key_prefix: str = Field("qgw", pattern=r"^[A-Za-z0-9_.:-]{1,32}$")

    #: A task still pending after this long expires and never runs.
    pending_ttl_s: int = Field(10800, ge=1)
    #: How long a finished task stays in Redis once its SQL row is written.
    done_ttl_s: int = Field(3600, ge=1)
    #: How long a finished task stays in Redis once its owner has read it.
    read_ttl_s: int = Field(20, ge=1)
    #: How long finished tasks stay in SQL (status reads them there once Redis let them go).
    db_retention_s: int = Field(259200, ge=1)
    #: How often finished tasks move from the Redis outbox to SQL, and rows per transaction.
    outbox_interval_ms: int = Field(500, ge=10)
    outbox_batch: int = Field(500, ge=1, le=5000)
    #: Bytes of results per outbox transaction (one larger result goes alone).
    outbox_batch_bytes: int = Field(16 << 20, ge=1 << 20, le=256 << 20)
    #: How often tasks pending past QGW_PENDING_TTL_S are marked `expired` (claims never
    #: start one anyway).
    expiry_interval_ms: int = Field(1000, ge=10)
    #: How often the janitor deletes rows older than QGW_DB_RETENTION_S, and rows per DELETE.
    janitor_interval_s: float = Field(300.0, gt=0)
    janitor_batch: int = Field(1000, ge=1, le=1000)

    #: The largest request body the API reads; a larger one is answered 413.
    max_body_bytes: int = Field(1_048_576, ge=1024)
    #: Requests the API serves at once; beyond, 503 (Retry-After: 1) before the body is read,
    #: so the process never runs out of descriptors and /healthz, /readyz and /metrics (never
    #: refused) still get in. 0: three quarters of the open-files limit (app/connections.py).
    max_connections: int = Field(0, ge=0, le=10_000_000)
    #: A request body must arrive whole within this many seconds of the route starting to
    #: read it, else 408 and the connection is closed (slow or stalled clients hold sockets).
    body_timeout_s: float = Field(10.0, gt=0, le=3600)
    #: The largest upstream answer kept as a task's result; a larger one fails the task (not
    #: retried). Answers above QGW_RESULT_INLINE_BYTES stream into the result store, so this
    #: may be up to 5 GiB.
    max_result_bytes: int = Field(8 << 20, ge=1024, le=5 << 30)
    #: Answers up to this size stay in the task (Redis, SQL); larger ones go to the result
    #: store as they arrive and the task keeps a reference (at most 11,000,000: its base64
    #: and its row fit a MySQL MEDIUMTEXT and packet).
    result_inline_bytes: int = Field(262_144, ge=0, le=MAX_INLINE_BYTES)
    #: Where large answers go: `file://<dir>` or `s3://<bucket>[/<prefix>]` (credentials and
    #: endpoint from AWS_* variables); unset: `file://<QGW_DATA_DIR>/results`.
    result_store: str | None = Field(None, pattern=r"^(file://|s3://[a-z0-9][a-z0-9.-]{1,62})")
    #: The result store's sweep deletes objects no task refers to once they are this old (an
    #: answer stored just now is referenced by its ack a moment later), and what a killed
    #: process left of an upload begun that long ago (app/lifecycle/orphans.py).
    result_sweep_grace_s: float = Field(3600.0, ge=0)
    #: How often the result store is swept: once per interval across all dispatchers (one
    #: of them holds a Redis lock for the interval and sweeps).
    result_sweep_interval_s: float = Field(300.0, gt=0)
    #: An answer's every write must complete within this many seconds, else the request ends
    #: and its connection is reset, unsent bytes dropped (a client that stops reading pins
    #: nothing longer); 0: none.
    send_timeout_s: float = Field(30.0, ge=0, le=3600)
    #: Large reads (results from the result store, status answers with over 1 MiB of
    #: result inline) one API key may have at once on one API process; one more waits up to
    #: a second for a slot, then is answered 429 with Retry-After.
    max_large_reads_per_key: int = Field(8, ge=1, le=10_000)
    #: Upstream calls one dispatcher process keeps in flight, over all endpoints.
    dispatch_concurrency: int = Field(256, ge=1, le=100_000)
    #: How long a claim stays valid without a heartbeat; the executor renews it every third.
    lease_ms: int = Field(15_000, ge=500)
    #: How long the marker that says an API process still holds its proxied requests' callers
    #: outlives its last renewal (every fifth of it); at most QGW_LEASE_MS. A claim ends a
    #: proxied request whose marker stays gone for two fifths longer (2 s at least), and gives
    #: one another's claim admits a pickup lease this long (docs/guides/proxy.md). Longer rides
    #: out longer Redis outages; shorter frees the line sooner behind a process killed with
    #: requests in it.
    proxy_owner_ttl_ms: int = Field(10_000, ge=500)
    #: How often the reaper looks for expired leases.
    reap_interval_ms: int = Field(1000, ge=50)
    #: On SIGTERM, how long calls in flight may take to finish before their tasks are handed
    #: back to their queues (at once, not when their leases run out).
    shutdown_grace_s: float = Field(10.0, ge=0, le=3600)
    #: Socket timeout of a Redis command: a Redis that does not answer within it counts as
    #: unavailable (503 redis_unavailable).
    redis_timeout_s: float = Field(1.0, gt=0)
    #: Replicas that must have a submit before it is answered 202 (Redis WAIT, for at most
    #: half of QGW_REDIS_TIMEOUT_S); 0: answer once the master has it, as replication is
    #: asynchronous a failover can then lose the last acknowledged submits.
    redis_wait_replicas: int = Field(0, ge=0, le=16)
    #: Margin (ms) for the jitter between passing the rate limiter and the upstream receiving
    #: the call; at most interval_ms / 20 of an endpoint is used (app/ratelimit).
    rate_guard_ms: int = Field(20, ge=0, le=1000)
    #: Which headers carry the request line to `GET /auth/check`: those nginx sets
    #: (X-Original-*), those Traefik sets (X-Forwarded-*), or `both`: every one present must
    #: agree, so a header a client added can refuse a call but never let one through.
    auth_check_headers: Literal["both", "nginx", "traefik"] = "both"
    #: A webhook POST (docs/api.md) that has not answered within this many seconds is retried.
    webhook_timeout_s: float = Field(10.0, gt=0, le=120)
    #: `qgw serve` and `qgw dispatcher` migrate the database on start; false: they refuse to
    #: start on a database that is not at the newest revision, naming both.
    auto_migrate: bool = True
    #: debug adds a line per completed task.
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("secrets_key", "secrets_key_previous")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v:
            parse_key(v)  # a mistake is one line at start, not a failed call later
        return v or None

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v:
            parse_redis_url(v)  # a mistake is one line at start
        return v or None

    @field_validator("database_url")
    @classmethod
    def _db_scheme(cls, v: str | None) -> str | None:
        if v and not v.startswith(("sqlite+aiosqlite://", "mysql+aiomysql://")):
            raise ValueError("must start with sqlite+aiosqlite:// or mysql+aiomysql://")
        return v or None

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir.resolve()}/qgw.db"

    @property
    def result_store_url(self) -> str:
        return self.result_store or f"file://{(self.data_dir / 'results').resolve()}"

    @cached_property
    def admin_secret(self) -> str:
        return self.admin_token or _stored_secret(self.data_dir, "admin_token")

    @cached_property
    def permit_key(self) -> bytes:
        return (self.permit_secret or _stored_secret(self.data_dir, "permit_secret")).encode()

    @cached_property
    def keyring(self) -> Keyring:
        """The keys that seal and open upstream_headers (app/secrets.py)."""
        previous = parse_key(self.secrets_key_previous) if self.secrets_key_previous else None
        # The keys as written (hex or base64) never go into a log line either.
        logs.redact(*(k.strip() for k in (self.secrets_key, self.secrets_key_previous) if k))
        if self.secrets_key:
            return Keyring(parse_key(self.secrets_key), previous)
        path = self.data_dir / "secrets_key"
        try:
            text = _stored_secret(self.data_dir, path.name, new_key)
            logs.redact(text)
            return Keyring(parse_key(text), previous)
        except ValueError as exc:
            raise SettingsError(f"bad key file {path.resolve()}: {exc}") from None


def _stored_secret(data_dir: Path, name: str,
                   make: Callable[[], str] = lambda: secrets.token_urlsafe(32)) -> str:
    """A secret generated once and kept in the data dir, so restarts keep it. Processes
    starting together agree on one: it is linked into place only if none is there yet."""
    path = data_dir / name
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    draft = data_dir / f".{name}.{os.getpid()}"
    draft.unlink(missing_ok=True)  # left by a crashed process that had this pid
    # Created private (0600), never written first and restricted after: there is no moment
    # another user could open it.
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(make() + "\n")
    try:
        os.link(draft, path)
    except FileExistsError:  # another process was first: its secret stands
        pass
    except OSError:  # a file system without hard links
        if not path.exists():
            os.replace(draft, path)
    finally:
        draft.unlink(missing_ok=True)
    return path.read_text().strip()


class SettingsError(Exception):
    """A bad setting, already phrased as the one line the operator sees."""


def load_settings(**overrides: object) -> Settings:
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        name = "QGW_" + str(err["loc"][0]).upper() if err["loc"] else "settings"
        raise SettingsError(f"bad setting {name}: {err['msg']}") from None
    if not settings.secrets_key and (settings.data_dir / "secrets_key").exists():
        settings.keyring  # noqa: B018 - a damaged key file is one line before anything starts
    return settings
