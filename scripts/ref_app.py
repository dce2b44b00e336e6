"""docs/reference/settings.md, cli.md and metrics.md, from the Settings model, the argparse
parser and what a scrape of /metrics writes."""

from __future__ import annotations

import argparse
import inspect
import re
import typing
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen

from scripts.ref_http import cell, code

# --- settings ---------------------------------------------------------------------------------


def _comments(cls: type) -> dict[str, str]:
    """The `#:` comment lines just above each field of a class body (Sphinx's convention)."""
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = re.match(r"^    ([a-z_][a-z0-9_]*)\s*:", line)
        if match and pending:
            out[match[1]] = " ".join(pending)
        pending = []
    return out


def _type_name(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(code(a) for a in typing.get_args(annotation))
    if args and len(args) < len(typing.get_args(annotation)):
        return _type_name(args[0]) if len(args) == 1 else " or ".join(map(_type_name, args))
    return {str: "text", int: "integer", float: "number", bool: "true/false",
            Path: "path"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


_BOUNDS = ((Ge, "ge", "≥ {}"), (Gt, "gt", "> {}"), (Le, "le", "≤ {}"), (Lt, "lt", "< {}"),
           (MinLen, "min_length", "at least {} characters"),
           (MaxLen, "max_length", "at most {} characters"))


def _bounds(metadata: list[Any]) -> str:
    low = next((m.ge for m in metadata if isinstance(m, Ge)), None)
    high = next((m.le for m in metadata if isinstance(m, Le)), None)
    if low is not None and high is not None:  # the common case, said as the CLI says it
        metadata = [m for m in metadata if not isinstance(m, Ge | Le)]
    said = [f"{_number(low)}..{_number(high)}"] if low is not None and high is not None else []
    for m in metadata:
        for kind, attr, word in _BOUNDS:
            if isinstance(m, kind):
                said.append(word.format(_number(getattr(m, attr))))
        if getattr(m, "pattern", None):
            said.append("matches " + code(m.pattern))
    return ", ".join(said)


def _number(value: Any) -> str:
    """Sizes in bytes as powers of two are easier to read as MiB."""
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings_page() -> str:
    from app.settings import Settings

    notes = _comments(Settings)
    lines = ["# Settings", "",
             "Every setting of `qgw`, from its `Settings` model. Each is read from the "
             "environment variable named here, or from a `.env` file in the working directory; "
             "`--host` and `--port` of `qgw serve` and `qgw api` override those two. A bad value "
             "stops the process at start with one line naming the variable and what is wrong.",
             "", "| variable | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "unset" if default is None else code(
            str(default) if isinstance(default, Path) else _number(default)
            if isinstance(default, int) and not isinstance(default, bool) else
            str(default).lower() if isinstance(default, bool) else default)
        meaning = field.description or notes.get(name, "")
        lines.append(f"| `QGW_{name.upper()}` | {cell(_type_name(field.annotation))} "
                     f"| {cell(shown)} | {cell(_bounds(field.metadata))} | {cell(meaning)} |")
    return "\n".join(lines)


# --- cli --------------------------------------------------------------------------------------


def _commands(parser: argparse.ArgumentParser, path: str
              ) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser under `parser`, depth first, in the order `--help` lists them."""
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.extend(_commands(sub, f"{path} {name}"))
    return out


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=80)  # what a code block shows unscrolled
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _options(parser: argparse.ArgumentParser) -> list[str]:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        name = ", ".join(action.option_strings) or action.dest
        text = formatter._expand_help(action) if action.help else ""
        if action.choices is not None:  # said in the meaning: a long {a,b,c} crowds the column
            name += " CHOICE" if action.option_strings else ""
            text += "; one of " + ", ".join(f"`{c}`" for c in action.choices)
        elif action.option_strings and action.nargs != 0:
            name += " " + formatter._format_args(action, action.dest.upper())
        rows.append(f"| `{cell(name)}` | {'yes' if action.required else ''} | {cell(text)} |")
    if not rows:
        return []
    return ["| option | required | meaning |", "|---|---|---|", *rows, ""]


def cli_page() -> str:
    from app.cli import build_parser

    lines = ["# Command line", "",
             "Every command and option of `qgw` (the same as `python -m app`), from its parser: "
             "`qgw <command> --help` says the same. The admin commands take the admin API's "
             "fields as options and validate them with its models: what the API refuses with "
             "422, they refuse with the same message and exit code 2. Booleans take `yes`/`no` "
             "(or `true`/`false`, `on`/`off`, `1`/`0`).", ""]
    for path, parser in _commands(build_parser(), "qgw"):
        depth = min(path.count(" ") + 1, 4)
        lines += [f"{'#' * (depth + 1)} `{path}`", ""]
        if parser.description:
            lines += [parser.description.rstrip(".") + ".", ""]
        lines += ["```text", _usage(parser), "```", ""]
        lines += _options(parser)
    return "\n".join(lines)


# --- metrics ----------------------------------------------------------------------------------


def _example_scrape() -> str:
    """What /metrics writes for one endpoint that has every optional number (a rate, a further
    limit, an adaptive cap, an upstream pause, a task waiting), so every family shows its
    labels."""
    from app import metrics
    from app.endpoints import EndpointConfig
    from app.queue.presence import Dispatchers
    from app.queue.stats import (
        BOUNDS_MS,
        COUNTERS,
        HISTOGRAMS,
        EndpointStats,
        Histogram,
        Snapshot,
    )

    now = 1_800_000_000_000
    ep = EndpointConfig.model_validate({
        "id": "example", "target_url": "http://upstream.invalid/api", "rate": 5,
        "max_concurrency": 2, "concurrency": "adaptive",
        "limits": [{"rate": 100, "interval_ms": 60_000}]})
    stats = EndpointStats(
        endpoint=ep, pending=1, in_flight=1, counters=dict.fromkeys(COUNTERS, 0), exec_ms=1.0,
        slot_ms=1.0, histograms={h: Histogram([0] * (len(BOUNDS_MS) + 1), 0) for h in HISTOGRAMS},
        oldest_pending_ms=now, upstream_paused_until=now + 1000)
    snapshot = Snapshot([stats], Dispatchers(alive=1, in_flight=1, stale=[]), now)
    http = Counter({("/api/v1/tasks", "POST", 202): 1})
    return metrics.render(snapshot, True, http).decode()


def _families(text: str) -> list[tuple[str, str, str, list[str]]]:
    """(name, type, help, label names) of each qgw_ family, in the order written."""
    found: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if m := re.match(r"# (HELP|TYPE) (\S+) (.*)", line):
            entry = found.setdefault(m[2], {"labels": []})
            entry[m[1]] = m[3].replace("\\\\", "\\").replace("\\n", " ")
        elif line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            base = re.sub(r"_(bucket|count|sum|created)$", "", name)
            family = found.get(name) or found.get(base)
            if family is not None:
                for label in re.findall(r'(\w+)="', line):
                    if label != "le" and label not in family["labels"]:
                        family["labels"].append(label)
    return [(n, f.get("TYPE", ""), f.get("HELP", ""), f["labels"]) for n, f in found.items()
            if n.startswith("qgw_")]


def _registry_labels() -> dict[str, list[str]]:
    """Label names of this process's own metrics (prometheus-client writes none until a
    labelled metric is first used)."""
    from prometheus_client import REGISTRY

    out = {}
    for collector, names in REGISTRY._collector_to_names.items():
        for name in names:
            out[name] = list(getattr(collector, "_labelnames", ()))
    return out


def metrics_page() -> str:
    own = _registry_labels()
    lines = ["# Metrics", "",
             "Every `qgw_*` family that `GET /metrics` writes, from the code that writes it. "
             "Per-endpoint numbers (labelled `endpoint`) are read from Redis, where the scripts "
             "that move tasks keep them, so they are exact and the same whichever API process is "
             "scraped: aggregate several replicas with `max`, not `sum`. "
             "`qgw_submit_latency_seconds` and `qgw_http_requests_total` are the scraped "
             "process's own. prometheus-client's default `process_*` and `python_*` families "
             "are written too. How to use them: [metrics, alerts and dashboards]"
             "(../operations/metrics.md).", "",
             "| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, help_text, labels in _families(_example_scrape()):
        labels = labels or own.get(name, [])
        lines.append(f"| `{name}` | {kind} | {cell(', '.join(f'`{x}`' for x in labels))} "
                     f"| {cell(help_text)} |")
    return "\n".join(lines)
