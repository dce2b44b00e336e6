"""Command-line options made from the admin API's pydantic models, and validated by them.

Each field becomes `--field-name`, with help saying what it is, its range or choices and its
default. The values stay strings until the model validates them (in lax mode: a shell has
only strings), so the CLI accepts and refuses exactly what the API does, with its messages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing
from typing import Any, Literal, TypeVar

from annotated_types import Ge, Le, MaxLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from app.endpoints import LimitSpec
from app.startup import Refused

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
    "weight": "tasks a round its users take on a weighted endpoint",
}
_FALSY, _TRUTHY = ("no", "false", "off", "0"), ("yes", "true", "on", "1")
_LIMITS_FORMAT = ("comma-separated N/s, N/min, N/h, N/day, N/10s or N/500ms, each "
                  "optionally with :cost (per cost unit) and :fixed_window or :token_bucket, "
                  "e.g. 3/s,100/min,90000/min:cost; or a JSON list of objects with limiter, "
                  "rate, interval_ms and per; 'none' clears them")


def add_options(parser: argparse.ArgumentParser, model: type[BaseModel],
                skip: tuple[str, ...] = (), all_optional: bool = False) -> None:
    """`--name VALUE` for each field of `model`; unset options stay out of the namespace."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        if name == "upstream_headers":
            parser.add_argument(
                "--upstream-header", dest="upstream_header_lines", action="append",
                default=argparse.SUPPRESS, metavar="'NAME: VALUE'",
                help=_UPSTREAM_HEADER_HELP + ("; 'NAME:' with no value removes one, the others "
                                              "stay" if all_optional else ""))
            continue
        required = field.is_required() and not all_optional
        kind, choices = _kind(field.annotation)
        parser.add_argument(
            f"--{name.replace('_', '-')}", dest=name, required=required,
            default=argparse.SUPPRESS, help=_help(name, field, kind, choices, all_optional),
            **_parse_as(kind, choices))


def given(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The fields of `model` set on the command line, with `--limits` made into the API's
    objects (a bad one is refused in one line, exit 2, as the API's own checks are)."""
    out = {k: v for k, v in vars(args).items() if k in model.model_fields}
    if "upstream_header_lines" in vars(args):
        out["upstream_headers"] = header_lines(args.upstream_header_lines)
    for name, value in out.items():
        if _kind(model.model_fields[name].annotation)[0] == "limits":
            out[name] = parse_limits(value)
    return out


_UPSTREAM_HEADER_HELP = ("a header sent on every call to this endpoint (e.g. 'Authorization: "
                         "Bearer sk-...'), repeatable; stored encrypted, shown as <set>. "
                         "'NAME: @env:VAR' takes the value from the environment variable VAR, "
                         "'NAME: @file:PATH' from the file PATH (its last newline dropped), so "
                         "it is not on the command line (ps, shell history)")


def header_lines(lines: list[str]) -> dict[str, str]:
    """`Name: value` lines as the API's upstream_headers object (an empty value stays empty:
    `qgw endpoints update` reads it as "remove")."""
    out: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name.strip():
            raise Refused("--upstream-header: say 'Name: value' (a name, a colon, the value)",
                          exit_code=2)
        out[name.strip()] = _value(name.strip(), value.strip())
    return out


#: The longest value the server seals (app/secrets.py MAX_VALUE_BYTES; not imported: the CLI
#: stays light).
MAX_VALUE_BYTES = 4096


def _value(name: str, value: str) -> str:
    """The value itself, or read from where `@env:VAR` / `@file:PATH` says (an error names
    the variable or the file, never what they hold)."""
    if value.startswith("@env:"):
        var = value[len("@env:"):]
        if not var or var not in os.environ:
            raise Refused(f"--upstream-header {name}: the environment variable {var!r} is not "
                          "set", exit_code=2)
        return os.environ[var].strip()
    if value.startswith("@file:"):
        path = value[len("@file:"):]
        try:
            with open(path, encoding="utf-8") as f:
                # No more than a value may hold (the server refuses a longer one): a device
                # such as /dev/zero is read to that and refused, not to the memory's end.
                text = f.read(MAX_VALUE_BYTES + 3).rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise Refused(f"--upstream-header {name}: cannot read {path}: {reason}",
                          exit_code=2) from None
        if len(text.encode()) > MAX_VALUE_BYTES:
            raise Refused(f"--upstream-header {name}: {path} holds more than a value may "
                          f"({MAX_VALUE_BYTES} bytes)", exit_code=2)
        return text
    return value


_UNITS_MS = {"ms": 1, "s": 1000, "sec": 1000, "min": 60_000, "h": 3_600_000,
             "hour": 3_600_000, "d": 86_400_000, "day": 86_400_000}
_LIMIT = re.compile(r"^(\d+)\s*/\s*(\d*)\s*([a-z]+)((?::[a-z_]+)*)$")


def parse_limits(text: str) -> Any:
    """`3/s,100/min:token_bucket,90000/min:cost` or a JSON list as the API takes it: what the
    model then validates (a word after `:` other than request/cost is the limiter, so a wrong
    one gets the API's message listing the algorithms)."""
    text = text.strip()
    if text.lower() in ("none", ""):
        return []
    if text.startswith(("[", "{")):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise Refused(f"limits: not JSON ({exc}): {text!r}", exit_code=2) from None
    return [_limit(part.strip().lower()) for part in text.split(",")]


def _limit(part: str) -> dict[str, Any]:
    match = _LIMIT.match(part)
    if match is None or match[3] not in _UNITS_MS:
        raise Refused(f"limits: {part!r} is not a limit: say N/s, N/min, N/h or N/day (or "
                      "N/10s...), optionally :cost and :fixed_window or :token_bucket, or give "
                      "a JSON list (qgw endpoints add -h)", exit_code=2)
    spec: dict[str, Any] = {"rate": int(match[1]),
                            "interval_ms": int(match[2] or 1) * _UNITS_MS[match[3]]}
    for word in filter(None, match[4].split(":")):
        spec["per" if word in ("request", "cost") else "limiter"] = word
    return spec


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
    if origin is list and args and args[0] is LimitSpec:
        return "limits", ()
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
    if kind == "limits":  # parsed by `given`, so that a bad one is one line, as the API says it
        return {"metavar": "LIMITS"}
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
    if kind == "limits":
        notes.append(_LIMITS_FORMAT)
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
