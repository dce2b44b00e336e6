"""Command-line options made from the admin API's pydantic models, and validated by them.

Each field becomes `--field-name`, with help saying what it is, its range or choices and its
default. The values stay strings until the model validates them (in lax mode: a shell has
only strings), so the CLI accepts and refuses exactly what the API does, with its messages.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal, TypeVar

from annotated_types import Ge, Le, MaxLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)

#: Help for fields whose model gives no description.
HELP = {
    "id": "endpoint id: lower-case letters, digits, _ and -",
    "name": "a readable name",
    "target_url": "the business API's URL (http or https, no query string)",
    "methods": "HTTP methods callers may submit",
    "limiter": "rate-limit algorithm",
    "interval_ms": "the rate limit's interval",
    "avg_exec_ms": "expected call time, for wait estimates until measured",
    "timeout_ms": "timeout of one upstream call",
    "max_retries": "retries after a timeout, connection error, 429 or 5xx",
    "retry_backoff_ms": "first retry delay (doubles each time, with jitter)",
    "permit_ttl_s": "how long an online task's permit lives",
    "permit_max_uses": "calls one permit allows",
    "enabled": "accept submits (no: they get 404)",
    "max_concurrency": "upstream calls in flight at most",
    "max_queue_len": "pending tasks at most (then submits get 503)",
    "user_id": "the user the key belongs to",
    "tier": "a label for the key's user",
    "max_priority": "the highest priority the key may submit",
    "daily_quota": "tasks a day",
}
_FALSY, _TRUTHY = ("no", "false", "off", "0"), ("yes", "true", "on", "1")


def add_options(parser: argparse.ArgumentParser, model: type[BaseModel],
                skip: tuple[str, ...] = (), all_optional: bool = False) -> None:
    """`--name VALUE` for each field of `model`; unset options stay out of the namespace."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        required = field.is_required() and not all_optional
        kind, choices = _kind(field.annotation)
        parser.add_argument(
            f"--{name.replace('_', '-')}", dest=name, required=required,
            default=argparse.SUPPRESS, help=_help(name, field, kind, choices, all_optional),
            **_parse_as(kind, choices))


def given(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The fields of `model` set on the command line."""
    return {k: v for k, v in vars(args).items() if k in model.model_fields}


def validate(model: type[M], data: dict[str, Any]) -> M:
    """The API's validation of `data` (strings from the shell: lax, so "5" is 5 and "yes" is
    true; the constraints are the model's own). Raises pydantic's ValidationError."""
    return model.model_validate(data, strict=False)


def _kind(annotation: Any) -> tuple[str, tuple[str, ...]]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated or (origin in (typing.Union, types.UnionType)
                                       and len(args) == 1):
        return _kind(args[0])
    if origin is Literal:
        return "choice", tuple(str(a) for a in args)
    if origin is list and args and typing.get_origin(args[0]) is Literal:
        return "list", tuple(str(a) for a in typing.get_args(args[0]))
    if origin is list:
        return "list", ()
    if annotation is bool:
        return "bool", _TRUTHY[:1] + _FALSY[:1]
    if annotation in (int, float, str):
        return annotation.__name__, ()
    return "json", ()


def _parse_as(kind: str, choices: tuple[str, ...]) -> dict[str, Any]:
    if kind == "choice":
        return {"choices": choices, "metavar": "{" + ",".join(choices) + "}"}
    if kind == "list":
        return {"type": lambda s: [m.strip() for m in s.split(",")], "metavar": "A,B"}
    if kind == "bool":
        return {"type": _bool, "metavar": "yes|no"}
    if kind == "json":
        return {"type": _json, "metavar": "JSON"}
    return {"metavar": {"int": "N", "float": "X"}.get(kind, "TEXT")}


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUTHY or low in _FALSY:
        return low in _TRUTHY
    raise argparse.ArgumentTypeError(f"{text!r} is not yes or no (or true/false, on/off, 1/0)")


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None


def _help(name: str, field: FieldInfo, kind: str, choices: tuple[str, ...],
          all_optional: bool) -> str:
    text = "; ".join(t for t in (HELP.get(name), field.description) if t) or name.replace("_", " ")
    notes = []
    if kind == "list":
        notes.append("comma-separated" + (", of " + ", ".join(choices) if choices else ""))
    bounds = _bounds(field)
    if bounds:
        notes.append(bounds)
    if not all_optional and not field.is_required():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, bool):
            default = "yes" if default else "no"
        elif isinstance(default, list):
            default = ",".join(map(str, default))
        notes.append(f"default: {default if default not in ('', None) else 'none'}")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _bounds(field: FieldInfo) -> str:
    """`0..100`, `at least 1`, `at most 200 characters`: the field's constraints, as said."""
    low = next((m.ge for m in field.metadata if isinstance(m, Ge)), None)
    high = next((m.le for m in field.metadata if isinstance(m, Le)), None)
    if low is not None and high is not None:
        return f"{low}..{high}"
    if low is not None:
        return f"at least {low}"
    if high is not None:
        return f"at most {high}"
    longest = next((m.max_length for m in field.metadata if getattr(m, "max_length", None)
                    and not isinstance(m, MaxLen)), None)  # StringConstraints
    return f"at most {longest} characters" if longest else ""
