"""QGW_REDIS_URL: one Redis (`redis://`, `rediss://`, `unix://`), Sentinel or Cluster, and
the client for it.

redis-py parses only the first kind; the other two name several hosts, which `urlsplit` cannot
read, so they are parsed here, and every mistake is one line for the operator.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from types import CodeType
from typing import Any, Literal, TypeVar, cast
from urllib.parse import parse_qsl, unquote

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError, SlotNotCoveredError
from redis.retry import Retry

T = TypeVar("T")
Kind = Literal["single", "sentinel", "cluster"]
_KINDS: dict[str, tuple[Kind, bool]] = {
    "redis": ("single", False), "rediss": ("single", True), "unix": ("single", False),
    "redis+sentinel": ("sentinel", False), "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False), "rediss+cluster": ("cluster", True),
}
_DEFAULT_PORT = {"sentinel": 26379, "cluster": 6379}
SCHEMES = ", ".join(f"{s}://" for s in _KINDS)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    kind: Kind
    url: str
    tls: bool = False
    hosts: tuple[tuple[str, int], ...] = ()  # sentinels or cluster seed nodes
    service: str = ""  # the Sentinel master name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls_options: tuple[tuple[str, str], ...] = ()  # ssl_* query options of rediss+ URLs


def parse(url: str) -> RedisTarget:
    """The URL's parts, or a ValueError whose text names what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _KINDS:
        raise ValueError(f"must start with one of {SCHEMES}")
    kind, tls = _KINDS[scheme.lower()]
    if kind == "single":
        try:
            parse_url(url)
        except ValueError as exc:
            raise ValueError(str(exc).splitlines()[0]) from None
        number = rest.partition("?")[0].partition("/")[2].strip("/")
        if scheme != "unix" and number:
            _db(number)  # redis-py would quietly use database 0 instead
        return RedisTarget("single", url, tls)
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    creds, _, hostlist = netloc.rpartition("@")
    username, _, password = creds.partition(":")  # as redis-py reads `user@` and `:pw@`
    hosts = tuple(_host(h, _DEFAULT_PORT[kind]) for h in hostlist.split(","))
    parts = [p for p in path.split("/") if p]
    service, db = "", 0
    if kind == "sentinel":
        if not parts or len(parts) > 2:
            raise ValueError("a Sentinel URL ends in /<service>[/<db>], the master's name")
        service, db = unquote(parts[0]), _db(parts[1] if len(parts) > 1 else "0")
    elif parts:
        raise ValueError("a Cluster URL has no path: Redis Cluster has only database 0")
    return RedisTarget(kind, url, tls, hosts, service, db,
                       unquote(username) or None, unquote(password) or None, _tls(query, tls))


_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
                "ssl_check_hostname")


def _tls(query: str, tls: bool) -> tuple[tuple[str, str], ...]:
    """The TLS options of a Sentinel or Cluster URL (as redis-py reads them from a rediss://
    URL); any other option is refused rather than quietly dropped."""
    options = tuple(parse_qsl(query, keep_blank_values=True))
    for name, _ in options:
        if name not in _TLS_OPTIONS:
            raise ValueError(f"unknown option {name!r}: a Sentinel or Cluster URL takes only "
                             f"{', '.join(_TLS_OPTIONS)}")
        if not tls:
            raise ValueError(f"{name} needs TLS: use the rediss+ form of the URL")
    return options


def _tls_kwargs(target: RedisTarget) -> dict[str, Any]:
    if not target.tls:
        return {}
    kwargs: dict[str, Any] = {"ssl": True}
    for name, value in target.tls_options:
        kwargs[name] = value.lower() in ("1", "true", "yes") \
            if name == "ssl_check_hostname" else value
    return kwargs


def _host(item: str, default_port: int) -> tuple[str, int]:
    host, port = item, str(default_port)
    if item.startswith("["):  # [ipv6]:port
        host, _, tail = item[1:].partition("]")
        port = tail.removeprefix(":") or port
    elif ":" in item:
        host, _, port = item.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"bad host:port {item!r} (hosts are separated by commas)")
    return host, int(port)


def _db(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"bad database number {text!r}")
    return int(text)


# Past one lost SYN: Linux sends it again after 1 s, so a timeout of 1 s failed the request
# (a 503) whenever one was dropped, as under a burst of new connections on a busy host.
CONNECT_TIMEOUT_S = 2.0


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Follows the master Sentinel names (asked again whenever a connection is made, and a
    connection that meets a READONLY error is dropped: its server was demoted) and, like the
    pool of one Redis, waits for a free connection rather than failing past its size."""


class _SentinelRedis(Redis):
    """The master's client; closing it closes the clients of the sentinels too."""

    sentinels: Sentinel

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await self.sentinels.aclose()


def client(url: str, timeout_s: float | None, max_connections: int = 512) -> Redis:
    """A client whose pool waits for a free connection (redis-py's default pool fails with a
    ConnectionError past 100, which would read as "Redis down"), and which never re-sends a
    command: submit and claim are not safe to repeat after a connection dropped mid-command.
    With Redis down the API answers 503 within about a second (a refused connection fails at
    once; CONNECT_TIMEOUT_S bounds only a host that does not answer)."""
    options: dict[str, object] = dict(
        decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0), health_check_interval=30,
        max_connections=max_connections, timeout=timeout_s or 1.0,
    )
    target = parse(url)
    if target.kind == "single":
        return Redis.from_pool(BlockingConnectionPool.from_url(url, **options))
    if target.kind == "cluster":
        return _cluster(target, options)
    tls = _tls_kwargs(target)
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs={  # type: ignore[no-untyped-call]
        "socket_timeout": timeout_s, "socket_connect_timeout": CONNECT_TIMEOUT_S, **tls})
    master: _SentinelRedis = sentinel.master_for(
        target.service, redis_class=_SentinelRedis, connection_pool_class=_BlockingSentinelPool,
        db=target.db, username=target.username, password=target.password, **tls, **options)
    master.sentinels = sentinel
    return master


class WrongKind(Exception):
    """The server is not the kind the URL names: a configuration mistake, not an outage."""


async def connect(redis: Redis) -> None:
    """A Cluster client reads the slot map before it is shared: left to its first commands,
    run at once, each reads it and they trip over each other (closed connections). One Redis
    is asked whether it is a Cluster node: through `redis://` every other key would be MOVED."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()
        return
    try:
        info = await redis.execute_command("INFO", "cluster")  # type: ignore[no-untyped-call]
    except ResponseError:  # a server without the section is no Cluster node
        return
    if isinstance(info, dict) and str(info.get("cluster_enabled")) == "1":
        raise WrongKind("QGW_REDIS_URL names one Redis, but the server is a Redis Cluster "
                        "node: use redis+cluster://host:port[,host:port...]")


def is_cluster(url: str) -> bool:
    return parse(url).kind == "cluster"


def _cluster(target: RedisTarget, options: dict[str, Any]) -> Redis:
    """redis-py's Cluster client: it follows MOVED and ASK and, when a master stops answering,
    reads the slot map again (a failover or a reshard needs no restart). Its pools do not wait
    for a free connection, hence a size per node well above what this process runs at once.

    Typed as `Redis`: the gateway calls only the commands both clients share, and every key a
    call names belongs to one slot (core/keys.py)."""
    options = {k: v for k, v in options.items() if k not in ("timeout", "health_check_interval")}
    tls = _tls_kwargs(target)
    nodes = [ClusterNode(host, port) for host, port in target.hosts]
    return cast(Redis, _RedisCluster(
        startup_nodes=nodes, username=target.username, password=target.password,
        require_full_coverage=False, **tls, **options))


_UNREACHABLE = ("Redis Cluster cannot be connected", "startup_nodes could not agree",
                "All slots are not covered")


def _as_redis_error(exc: Exception) -> Exception | None:
    """What an exception of the Cluster client means to its callers, where redis-py raises it
    as something other than a RedisError: a ConnectionError for an outage (every node down,
    slots without a master, however redis-py reports them, a connection closed under a
    write), WrongKind for a node not in cluster mode; None for anything else (a bug of ours,
    left as it is)."""
    if isinstance(exc, RedisClusterException) and "Cluster mode is not enabled" in str(exc):
        return WrongKind("QGW_REDIS_URL names a Redis Cluster, but the server is not in "
                         "cluster mode: use redis:// (or redis+sentinel://) for it")
    if isinstance(exc, SlotNotCoveredError) or (
            isinstance(exc, RedisClusterException) and str(exc).startswith(_UNREACHABLE)):
        return RedisConnectionError(str(exc).splitlines()[0])
    if _closed_under_us(exc):
        return RedisConnectionError(f"connection closed while in use: {exc}")
    if _slot_not_in_map(exc):
        return RedisConnectionError(f"slot {exc} is served by no master (a failover under way)")
    return None


def _slot_not_in_map(exc: BaseException) -> bool:
    """A KeyError from the asyncio Cluster client's slot lookup: once its map was read again
    from nodes that list a slot as no one's (a master dead, its replica not promoted yet), a
    call to that slot raises KeyError where the sync client raises SlotNotCoveredError
    (redis-py 8.1 catches IndexError and TypeError only). Told apart by where it arose."""
    if not isinstance(exc, KeyError):
        return False
    code = _raised_in(exc)
    return code is not None and code.co_name == "get_node_from_slot" and \
        code.co_filename.endswith("redis/asyncio/cluster.py")


def _raised_in(exc: BaseException) -> CodeType | None:
    """The code of the innermost frame `exc` passed through: where it was raised."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code if tb is not None else None


def _closed_under_us(exc: BaseException) -> bool:
    """An error raised while writing to a connection that another task closed: redis-py's
    Cluster client closes every connection of a node it found dead, including ones in use,
    and the write then fails inside the event loop's transport instead of with a
    ConnectionError (redis-py #3546, #4287): an AttributeError or TypeError from asyncio's
    streams, a RuntimeError ("the handler is closed") from uvloop's. Told apart from a bug of
    ours by where it arose."""
    if not isinstance(exc, (AttributeError, TypeError, RuntimeError)):
        return False
    code = _raised_in(exc)
    where = code.co_filename if code is not None else ""
    if isinstance(exc, RuntimeError):
        return "uvloop" in where and "closed" in str(exc)
    return where.endswith(("redis/asyncio/connection.py", "asyncio/streams.py",
                           "asyncio/selector_events.py"))


async def _mapped(call: Awaitable[T]) -> T:
    """`call`'s answer, with the Cluster client's errors as _as_redis_error names them."""
    try:
        return await call
    except Exception as exc:
        if (mapped := _as_redis_error(exc)) is None:
            raise
        raise mapped from exc


class _RedisCluster(RedisCluster):
    """A Cluster that cannot be reached, or a connection closed under a write, is a
    ConnectionError as on one Redis (_as_redis_error): callers answer 503 or retry and loops
    carry on, instead of a 500 or a dead loop in the middle of a failover."""

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        return await _mapped(super().initialize(*args, **kwargs))

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await _mapped(super().execute_command(*args, **kwargs))

    def pipeline(self, transaction: Any | None = None,
                 shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused by redis-py
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]


class _ClusterPipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True,
                      allow_redirections: bool = True) -> list[Any]:
        return await _mapped(super().execute(raise_on_error, allow_redirections))
