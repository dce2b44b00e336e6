"""`qgw endpoints ...`, `qgw keys ...`, `qgw tasks ...`: the admin API from the shell, with its
models' validation (app/cli_options.py) and its stores.

Read-only commands read SQL only: no migration, no Redis, no embedded server started. Every
command works on the gateway's own database (app/startup.py require_db), and says what went
wrong in one line: the API's error message, or which server could not be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from app.cli_options import add_options, given, validate
from app.endpoints import EndpointConfig, EndpointPatch
from app.errors import ApiError, describe
from app.models import ApiKeyCreate
from app.secrets import AS_IS, MASK
from app.settings import Settings
from app.startup import Refused, hide_password, one_line, require_db
from app.tiers import TierSettings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from app.queue.search import TaskFilter
    from app.runtime import Runtime
    from app.store import EndpointStore, KeyStore


class Stores(Protocol):
    """What the read-only commands use: a Runtime has it, and so has `_SqlOnly`."""

    endpoints: EndpointStore
    key_store: KeyStore


#: A command, once its arguments are validated: what it does with the stores or the runtime.
Job = Callable[[Any], Awaitable[Any]]
Prepare = Callable[[argparse.Namespace], Job]


def add_parsers(sub: Any) -> None:
    eps = _group(sub, "endpoints", "the endpoint table: the business APIs behind the gateway")
    add = _action(eps, "add", "register an endpoint", _endpoint_add, needs_runtime=True)
    add.add_argument("id", help="endpoint id: lower-case letters, digits, _ and -")
    add.add_argument("target_url", help="the business API's URL, e.g. http://svc:9000/api/gen")
    add_options(add, EndpointConfig, skip=("id", "target_url"))
    _action(eps, "list", "every endpoint, as JSON", _endpoint_list)
    _with_id(_action(eps, "show", "one endpoint, as JSON", _endpoint_show), "endpoint id")
    update = _with_id(_action(eps, "update", "change some fields of an endpoint (others stay)",
                              _endpoint_update, needs_runtime=True), "endpoint id")
    add_options(update, EndpointPatch, all_optional=True)
    for name, doc, paused in (("pause", "stop dispatching; submits are still accepted", True),
                              ("resume", "dispatch again after pause", False)):
        _with_id(_action(eps, name, doc, _set_paused(paused), needs_runtime=True), "endpoint id")
    _with_id(_action(eps, "purge", "cancel every pending task of an endpoint", _endpoint_purge,
                     needs_runtime=True), "endpoint id")
    _with_id(_action(eps, "rm", "delete an idle endpoint (disables it first)", _endpoint_rm,
                     needs_runtime=True), "endpoint id")

    keys = _group(sub, "keys", "API keys of the callers")
    create = _action(keys, "create", "create a key; it is printed once, stored only as a hash",
                     _key_create, needs_runtime=True)
    add_options(create, ApiKeyCreate)
    _action(keys, "list", "every key (never the key itself), as JSON", _key_list)
    _with_id(_action(keys, "revoke", "revoke a key at once, on every replica", _key_revoke,
                     needs_runtime=True), "key id (from `qgw keys list`)")

    secrets = _group(sub, "secrets", "the key that encrypts endpoints' upstream_headers")
    _action(secrets, "rotate", "encrypt every endpoint's upstream_headers again with "
            "QGW_SECRETS_KEY (run with the old key as QGW_SECRETS_KEY_PREVIOUS)",
            _secrets_rotate, needs_runtime=True)

    tiers = _group(sub, "tiers", "tiers of API keys: their weight on weighted endpoints")
    put = _with_id(_action(tiers, "set", "set a tier's weight (default 1)", _tier_set,
                           needs_runtime=True), "tier name, as the keys' tier")
    add_options(put, TierSettings)
    _action(tiers, "list", "every tier with a weight, as JSON", _tier_list, needs_runtime=True)

    tasks = _group(sub, "tasks", "any user's task, for operators")
    listed = _action(tasks, "list", "a page of tasks as JSON: an endpoint's pending or "
                     "processing ones in dispatch order, or finished ones of every endpoint "
                     "(newest first; --endpoint, --since, --until, --id narrow them)",
                     _task_list, needs_runtime=True)
    listed.add_argument("id", nargs="?", metavar="endpoint", help="endpoint id (as --endpoint)")
    _filters(listed, "which tasks (default: pending with an endpoint, else any finished)")
    listed.add_argument("--limit", type=int, default=50,
                        help="tasks a page, 1 to 200 (default: 50)")
    listed.add_argument("--cursor", help="the next_cursor of the previous page")
    _with_id(_action(tasks, "show", "status, owner, endpoint and request of a task",
                     _task_show, needs_runtime=True), "task id", "task_id")
    retry = _action(tasks, "retry", "run a failed or expired task again, or every one a filter "
                    "matches (--status failed|expired [--endpoint E] [--since T])", _task_retry,
                    needs_runtime=True)
    retry.add_argument("task_id", nargs="?", help="task id (or a filter instead)")
    _filters(retry, "failed or expired (with a filter)")
    cancel = _action(tasks, "cancel", "cancel a pending or running task, or every one a filter "
                     "matches (--endpoint E [--status pending|processing])", _task_cancel,
                     needs_runtime=True)
    cancel.add_argument("task_id", nargs="?", help="task id (or a filter instead)")
    _filters(cancel, "pending or processing (with a filter; default both)")


def _filters(parser: argparse.ArgumentParser, status_doc: str) -> None:
    parser.add_argument("--status", choices=_STATUSES, help=status_doc)
    parser.add_argument("--endpoint", help="only this endpoint's tasks")
    for name, edge in (("since", "from"), ("until", "before")):
        parser.add_argument(f"--{name}", help=f"only tasks that ended (live ones: were "
                            f"submitted) {edge} T: an ISO 8601 time, or an age such as 30m, "
                            "2h, 7d")
    parser.add_argument("--id", dest="id_prefix", help="only task ids that begin so")


def _group(sub: Any, name: str, doc: str) -> Any:
    parser = sub.add_parser(name, help=doc, description=doc)
    return parser.add_subparsers(title="actions", metavar="<action>", required=True)


def _action(group: Any, name: str, doc: str, prepare: Prepare,
            needs_runtime: bool = False) -> argparse.ArgumentParser:
    """An action; writes (and reads of Redis) start a runtime, the others read SQL only."""
    parser: argparse.ArgumentParser = group.add_parser(name, help=doc, description=doc)
    parser.set_defaults(run=_runner(prepare, needs_runtime), quiet=True)
    return parser


def _with_id(parser: argparse.ArgumentParser, doc: str, dest: str = "id") -> Any:
    parser.add_argument(dest, help=doc)
    return parser


def _runner(prepare: Prepare, needs_runtime: bool) -> Callable[[Settings, Any], None]:
    def run(settings: Settings, args: argparse.Namespace) -> None:
        try:
            job = prepare(args)  # bad input is refused before any server is asked
        except ValidationError as exc:
            raise Refused(describe(exc), exit_code=2) from None
        require_db(settings)
        try:
            result = asyncio.run(_run(settings, job, needs_runtime))
        except ApiError as exc:
            raise Refused(exc.message) from None
        if result is not None:
            print(json.dumps(result, indent=2, default=str))

    return run


async def _run(settings: Settings, job: Job, needs_runtime: bool) -> Any:
    from redis.exceptions import RedisError
    from sqlalchemy.exc import SQLAlchemyError

    from app.redis_url import WrongKind

    target: Runtime | _SqlOnly
    if needs_runtime:  # the runtime's imports (the dispatcher, its HTTP client...) cost a read time
        from app.runtime import Runtime

        target = Runtime(settings)
    else:
        target = _SqlOnly.of(settings)
    try:
        try:
            await target.start()
        except BaseException:
            with contextlib.suppress(Exception):  # whatever part of it had started
                await target.stop()
            raise
        try:
            return await job(target)
        finally:
            await target.stop()
    except WrongKind as exc:
        raise Refused(str(exc)) from None
    except (RedisError, OSError) as exc:
        url = getattr(target, "redis_url", None) or settings.redis_url or "(embedded)"
        raise Refused(f"cannot reach Redis at {hide_password(url)}: {one_line(exc)}; is the "
                      "gateway's Redis running (QGW_REDIS_URL)?") from None
    except SQLAlchemyError as exc:
        raise Refused(f"database {hide_password(settings.db_url)}: {one_line(exc)} (is it "
                      "running, and migrated: `qgw migrate`?)") from None


@dataclass
class _SqlOnly:
    """The stores over SQL alone. Their Redis mirrors are never touched by reads (SQL is the
    source of truth), so they get a client that never connects."""

    engine: AsyncEngine
    endpoints: EndpointStore
    key_store: KeyStore

    @classmethod
    def of(cls, settings: Settings) -> _SqlOnly:
        from redis.asyncio import Redis

        from app.core.keys import Keys
        from app.core.registry import Mirror
        from app.db import make_engine, set_request_timeout
        from app.store import EndpointStore, KeyStore

        set_request_timeout(settings.sql_timeout_s)
        engine, unused = make_engine(settings.db_url), Redis()
        keys = Keys(settings.key_prefix)
        no_mirror: Mirror[Any] = Mirror(unused, keys, "endpoints", dict, _never)
        return cls(engine, EndpointStore(engine, no_mirror), KeyStore(engine, no_mirror))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        from app.db import settle

        await settle()
        await self.engine.dispose()


async def _never() -> dict[str, str]:
    raise AssertionError("read-only commands do not rebuild mirrors")


# -- endpoints -------------------------------------------------------------------------------

def _endpoint_add(args: argparse.Namespace) -> Job:
    config = validate(EndpointConfig, {"id": args.id, "target_url": args.target_url,
                                       **given(args, EndpointConfig)})

    async def job(rt: Runtime) -> Any:
        return (await rt.endpoints.create(config)).model_dump()

    return job


def _endpoint_list(args: argparse.Namespace) -> Job:
    async def job(s: Stores) -> Any:
        return [e.model_dump() for e in await s.endpoints.list()]

    return job


def _endpoint_show(args: argparse.Namespace) -> Job:
    async def job(s: Stores) -> Any:
        return (await s.endpoints.get(args.id)).model_dump()

    return job


def _endpoint_update(args: argparse.Namespace) -> Job:
    changes = given(args, EndpointPatch)
    if not changes:
        raise Refused("nothing to change: give at least one option (qgw endpoints update -h)",
                      exit_code=2)
    headers = changes.pop("upstream_headers", None)
    if headers is not None:  # the non-empty ones are checked here; empty ones remove
        validate(EndpointPatch, {"upstream_headers": {k: v for k, v in headers.items() if v}})
    patch = validate(EndpointPatch, changes).model_dump(exclude_unset=True, exclude_none=True,
                                                        context=AS_IS)
    return _update(args.id, patch, headers)


def merge_headers(current: dict[str, str], given: dict[str, str]) -> dict[str, str]:
    """The endpoint's upstream_headers with `given` set (an empty value removes that name),
    the others kept as they are (`<set>`: the store keeps their sealed values)."""
    gone = {name.lower() for name in given}
    out = {name: MASK for name in current if name.lower() not in gone}
    out.update({name: value for name, value in given.items() if value})
    return out


def _set_paused(paused: bool) -> Prepare:
    return lambda args: _update(args.id, {"paused": paused})


def _update(endpoint_id: str, changes: dict[str, Any],
            headers: dict[str, str] | None = None) -> Job:
    async def job(rt: Runtime) -> Any:
        if headers is not None:
            current = (await rt.endpoints.get(endpoint_id)).upstream_headers
            changes["upstream_headers"] = merge_headers(current, headers)
        return (await rt.endpoints.update(endpoint_id, changes)).model_dump()

    return job


def _endpoint_purge(args: argparse.Namespace) -> Job:
    async def job(rt: Runtime) -> Any:
        from app.queue import operator

        await rt.endpoints.get(args.id)  # 404 for an unknown one
        return {"endpoint": args.id, "cancelled": await operator.purge(rt.queue, args.id)}

    return job


def _endpoint_rm(args: argparse.Namespace) -> Job:
    async def job(rt: Runtime) -> Any:
        await rt.retire_endpoint(args.id)
        return {"endpoint": args.id, "deleted": True}  # said, not silence

    return job


# -- keys ------------------------------------------------------------------------------------

def _key_create(args: argparse.Namespace) -> Job:
    body = validate(ApiKeyCreate, given(args, ApiKeyCreate))

    async def job(rt: Runtime) -> Any:
        plain, view = await rt.key_store.create(**body.model_dump())
        return {**view, "key": plain}

    return job


def _key_list(args: argparse.Namespace) -> Job:
    async def job(s: Stores) -> Any:
        return await s.key_store.list()

    return job


def _key_revoke(args: argparse.Namespace) -> Job:
    async def job(rt: Runtime) -> Any:
        await rt.key_store.revoke(args.id)
        return {"key_id": args.id, "revoked": True}

    return job


# -- secrets ---------------------------------------------------------------------------------

def _secrets_rotate(args: argparse.Namespace) -> Job:
    async def job(rt: Runtime) -> Any:
        return {"key_id": rt.settings.keyring.current_id, **await rt.endpoints.reseal()}

    return job


# -- tiers -----------------------------------------------------------------------------------

def _tier_set(args: argparse.Namespace) -> Job:
    body = validate(TierSettings, given(args, TierSettings))

    async def job(rt: Runtime) -> Any:
        return (await rt.tiers.set(args.id, body.weight)).model_dump()

    return job


def _tier_list(args: argparse.Namespace) -> Job:
    async def job(rt: Runtime) -> Any:
        return [t.model_dump() for t in await rt.tiers.list()]

    return job


# -- tasks -----------------------------------------------------------------------------------

_STATUSES = ("pending", "processing", "completed", "failed", "cancelled", "expired")


def _task_list(args: argparse.Namespace) -> Job:
    if not 1 <= args.limit <= 200:
        raise Refused("--limit must be from 1 to 200", exit_code=2)
    f = _filter(args, args.id)

    async def job(rt: Runtime) -> Any:
        from app.queue import listing, search

        if f.endpoint and not (f.since or f.until or f.id_prefix) and (
                f.status is None or f.status in listing.LIVE):
            await rt.endpoints.get(f.endpoint)
            return await listing.list_tasks(rt.queue, f.endpoint, f.status or "pending",
                                            args.limit, args.cursor)
        return await search.search(rt.queue, rt.registry, f, args.limit, args.cursor)

    return job


def _filter(args: argparse.Namespace, endpoint: str | None = None) -> TaskFilter:
    """The filter options as the search takes them; bad ones refused (exit code 2)."""
    from app.queue.search import ID_PREFIX, TaskFilter

    if endpoint and args.endpoint and endpoint != args.endpoint:
        raise Refused("two different endpoints given", exit_code=2)
    if args.id_prefix is not None and not re.fullmatch(ID_PREFIX, args.id_prefix):
        # Not a pattern: `?` or `*` would match every id in SQL (a bulk retry of all)
        raise Refused("--id takes the beginning of a task id (0-9, a-z, '.', '_', '-')",
                      exit_code=2)
    return TaskFilter(args.status, endpoint or args.endpoint, _when(args.since, "--since"),
                      _when(args.until, "--until"), args.id_prefix)


_AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _when(text: str | None, option: str) -> datetime | None:
    """An ISO 8601 time or an age (`30m`: half an hour ago), as naive UTC."""
    from app.queue.search import utc

    if text is None:
        return None
    age = re.fullmatch(r"(\d{1,7})([smhd])", text.strip())
    if age:
        ago = timedelta(seconds=int(age[1]) * _AGES[age[2]])
        try:
            return datetime.now(UTC).replace(tzinfo=None) - ago
        except OverflowError:  # before the year 1: every time there is
            return datetime.min
    try:
        return utc(datetime.fromisoformat(text.strip().replace("Z", "+00:00")))
    except ValueError:
        raise Refused(f"{option} takes an ISO 8601 time or an age such as 30m, 2h, 7d",
                      exit_code=2) from None


def _task_show(args: argparse.Namespace) -> Job:
    async def job(rt: Runtime) -> Any:
        from app.queue import operator

        return _readable(await operator.show(rt.queue, rt.registry, args.task_id))

    return job


def _readable(shown: dict[str, Any]) -> dict[str, Any]:
    """A binary or external result is named by its size and type, never printed."""
    if shown.get("result_encoding") in ("base64", "external"):
        shown["task_result"] = (f"<{shown.get('result_bytes')} bytes of "
                                f"{shown.get('result_content_type') or 'unknown type'}: GET "
                                f"/api/v1/tasks/{shown['task_id']}/result>")
    return shown


def _one_or_filter(args: argparse.Namespace) -> TaskFilter | None:
    """None for one task named by id, else the filter (which must say something)."""
    f = _filter(args)
    if args.task_id is not None:
        if not f.empty:
            raise Refused("give a task id or a filter, not both", exit_code=2)
        return None
    if f.empty:
        raise Refused("give a task id, or a filter (--status, --endpoint, --since, --until, "
                      "--id)", exit_code=2)
    return f


def _task_retry(args: argparse.Namespace) -> Job:
    f = _one_or_filter(args)

    async def job(rt: Runtime) -> Any:
        from app.queue import bulk, operator

        if f is not None:
            return await bulk.retry(rt.queue, rt.registry, f)
        return await operator.retry(rt.queue, rt.registry, args.task_id)

    return job


def _task_cancel(args: argparse.Namespace) -> Job:
    f = _one_or_filter(args)

    async def job(rt: Runtime) -> Any:
        from app.queue import bulk, operator

        if f is not None:
            return await bulk.cancel(rt.queue, rt.registry, f)
        status = await operator.cancel(rt.queue, args.task_id)
        return {"task_id": args.task_id, "task_status": status.value}

    return job
