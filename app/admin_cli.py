"""`qgw endpoints ...` and `qgw keys ...`: the admin API's rules, from the shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from app.endpoints import EndpointConfig
from app.errors import ApiError, describe
from app.runtime import Runtime
from app.settings import Settings

_FIELDS = {name: f for name, f in EndpointConfig.model_fields.items() if name != "id"}


def add_parsers(sub: Any) -> None:
    ep = sub.add_parser("endpoints", help="the endpoint table").add_subparsers(
        required=True, metavar="action")
    add = ep.add_parser("add", help="register an endpoint")
    add.add_argument("id")
    add.add_argument("target_url")
    for name, field in _FIELDS.items():
        if name == "target_url":
            continue
        kind = field.annotation
        if name in ("methods", "forward_headers"):
            add.add_argument(f"--{name.replace('_', '-')}", type=lambda s: s.split(","),
                             help="comma-separated, e.g. POST,GET or X-Tenant,X-Request-Id")
        elif kind is bool:
            add.add_argument(f"--{name.replace('_', '-')}", type=lambda s: s == "true",
                             metavar="true|false")
        else:
            add.add_argument(f"--{name.replace('_', '-')}", type=int if kind is int else str)
    add.set_defaults(run=_run(_endpoint_add))
    ep.add_parser("list").set_defaults(run=_run(_endpoint_list))
    for action, fn in (("show", _endpoint_show), ("rm", _endpoint_rm)):
        p = ep.add_parser(action)
        p.add_argument("id")
        p.set_defaults(run=_run(fn))

    keys = sub.add_parser("keys", help="API keys").add_subparsers(required=True, metavar="action")
    create = keys.add_parser("create", help="create a key; it is printed once")
    create.add_argument("--user-id", type=int, required=True)
    create.add_argument("--tier", default="standard")
    create.add_argument("--max-priority", type=int, default=0)
    create.add_argument("--daily-quota", type=int, default=0)
    create.set_defaults(run=_run(_key_create))
    keys.add_parser("list").set_defaults(run=_run(_key_list))
    revoke = keys.add_parser("revoke")
    revoke.add_argument("id")
    revoke.set_defaults(run=_run(_key_revoke))


Action = Callable[[Runtime, argparse.Namespace], Awaitable[Any]]


def _run(action: Action) -> Callable[[Settings, argparse.Namespace], None]:
    def run(settings: Settings, args: argparse.Namespace) -> None:
        from app.cli import prepare_db

        prepare_db(settings)
        try:
            result = asyncio.run(_with_runtime(settings, args, action))
        except ApiError as exc:
            print(f"qgw: {exc.message}", file=sys.stderr)
            sys.exit(1)
        except ValidationError as exc:
            print(f"qgw: {describe(exc)}", file=sys.stderr)
            sys.exit(2)
        if result is not None:
            print(json.dumps(result, indent=2, default=str))

    return run


async def _with_runtime(settings: Settings, args: argparse.Namespace, action: Action) -> Any:
    rt = Runtime(settings)
    await rt.start()
    try:
        return await action(rt, args)
    finally:
        await rt.stop()


async def _endpoint_add(rt: Runtime, args: argparse.Namespace) -> Any:
    given = {k: v for k, v in vars(args).items() if k in _FIELDS and v is not None}
    config = EndpointConfig.model_validate({"id": args.id, **given})
    return (await rt.endpoints.create(config)).model_dump()


async def _endpoint_list(rt: Runtime, args: argparse.Namespace) -> Any:
    return [e.model_dump() for e in await rt.endpoints.list()]


async def _endpoint_show(rt: Runtime, args: argparse.Namespace) -> Any:
    return (await rt.endpoints.get(args.id)).model_dump()


async def _endpoint_rm(rt: Runtime, args: argparse.Namespace) -> None:
    await rt.retire_endpoint(args.id)


async def _key_create(rt: Runtime, args: argparse.Namespace) -> Any:
    plain, view = await rt.key_store.create(args.user_id, args.tier, args.max_priority,
                                            args.daily_quota)
    return {**view, "key": plain}


async def _key_list(rt: Runtime, args: argparse.Namespace) -> Any:
    return await rt.key_store.list()


async def _key_revoke(rt: Runtime, args: argparse.Namespace) -> None:
    await rt.key_store.revoke(args.id)
