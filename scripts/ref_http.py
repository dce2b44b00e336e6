"""docs/reference/http.md from the app's OpenAPI document: every route, parameter, body, answer
and schema, as the gateway serves them at /openapi.json."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

Schema = dict[str, Any]
SECTIONS = (  # by path prefix, in this order; what matches none goes under Operations
    ("/api/", "Public API", "Callers, with an API key."),
    ("/auth/", "Gateway check", "For nginx `auth_request` and Traefik `forwardAuth`."),
    ("/admin/", "Admin API", "Operators, with the admin token."),
    ("", "Operations", "Probes, metrics and pages; no token."),
)
AUTH = {"apiKey": "API key (`Authorization: Bearer`)", "apiKeyHeader": "API key (`X-API-Key`)",
        "adminToken": "admin token"}


def openapi() -> Schema:
    """The document the gateway serves, made by the app factory without starting anything."""
    from app.main import create_app
    from app.runtime import Runtime
    from app.settings import Settings

    with tempfile.TemporaryDirectory() as data_dir:  # the secrets are not looked for there
        settings = Settings(admin_token="0" * 16, permit_secret="0", data_dir=Path(data_dir),
                            _env_file=None)
        doc = create_app(Runtime(settings), manage=False).openapi()
    copy: Schema = json.loads(json.dumps(doc))  # plain data: nothing of the app's own objects
    return copy


def cell(text: object) -> str:
    """Text fit for one Markdown table cell: one line; outside code spans, pipes escaped and
    `<name>` shown rather than taken for an HTML tag (inside them Python-Markdown keeps both)."""
    parts = " ".join(str(text).split()).split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|").replace("<", "&lt;")
                    for i, p in enumerate(parts))


def code(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return f"`{text}`" if "`" not in text else f"`` {text} ``"


def anchor(name: str) -> str:
    return "schema-" + name.lower()


def ref_name(schema: Schema) -> str | None:
    ref = schema.get("$ref", "")
    return ref.rsplit("/", 1)[-1] if ref else None


def type_of(schema: Schema) -> str:
    """A readable type: `integer`, `list of string`, `TaskView` (linked), `string or null`."""
    if (name := ref_name(schema)) is not None:
        return f"[{name}](#{anchor(name)})"
    if "anyOf" in schema:
        kinds = [type_of(s) for s in schema["anyOf"]]
        return " or ".join(dict.fromkeys(kinds))
    kind = schema.get("type")
    if kind == "array":
        return "list of " + type_of(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map of string to " + type_of(schema["additionalProperties"])
    if "const" in schema:
        return code(schema["const"])
    return str(kind or "any")


def rules_of(schema: Schema) -> list[str]:
    """Constraints as said: `0..1000`, `at most 2048 characters`, one of ..."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") != "null":
            return rules_of(branch)
    out = []
    if "enum" in schema:
        out.append("one of " + ", ".join(code(v) for v in schema["enum"]))
    low = schema.get("minimum")
    high = schema.get("maximum")
    if "exclusiveMinimum" in schema:
        out.append(f"more than {schema['exclusiveMinimum']}")
    if low is not None and high is not None:
        out.append(f"{low}..{high}")
    elif low is not None:
        out.append(f"at least {low}")
    elif high is not None:
        out.append(f"at most {high}")
    for key, say in (("minLength", "at least {} characters"),
                     ("maxLength", "at most {} characters"),
                     ("minItems", "at least {} items"), ("maxItems", "at most {} items")):
        if key in schema:
            out.append(say.format(schema[key]))
    if "pattern" in schema:
        out.append("matches " + code(schema["pattern"]))
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        out.extend("each " + r for r in rules_of(schema["items"]))
    return out


def rules_cell(schema: Schema, required: bool) -> str:
    """Required or the default, then the constraints: one column rather than three."""
    said = ["required"] if required else []
    if "default" in schema:
        said.append("default " + code(json.dumps(schema["default"])))
    return cell("; ".join(said + rules_of(schema)))


def fields_table(schema: Schema) -> list[str]:
    props: dict[str, Schema] = schema.get("properties", {})
    if not props:
        return [f"Type: {type_of(schema)}.", ""]
    required = set(schema.get("required", []))
    lines = ["| field | type | rules | meaning |", "|---|---|---|---|"]
    for name, prop in props.items():
        lines.append(f"| `{name}` | {cell(type_of(prop))} | {rules_cell(prop, name in required)} "
                     f"| {cell(prop.get('description', ''))} |")
    return [*lines, ""]


def body_of(content: dict[str, Any]) -> tuple[str, Schema | None]:
    """The media type of a body and its schema (the first declared)."""
    media, spec = next(iter(content.items()))
    return media, spec.get("schema")


def operation(method: str, path: str, op: Schema) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", "",
             f"`{op['operationId']}`: {op.get('summary', '')}.", ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    security = op.get("security")
    who = " or ".join(dict.fromkeys(AUTH[k] for s in security for k in s)) if security else "none"
    lines += [f"Authentication: {who}.", ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | rules | meaning |", "|---|---|---|---|---|"]
        for p in params:
            s = p.get("schema", {})
            lines.append(f"| `{p['name']}` | {p['in']} | {cell(type_of(s))} "
                         f"| {rules_cell(s, bool(p.get('required')))} "
                         f"| {cell(p.get('description', ''))} |")
        lines.append("")
    if "requestBody" in op:
        media, schema = body_of(op["requestBody"]["content"])
        need = "required" if op["requestBody"].get("required") else "optional"
        lines += [f"Request body ({need}, `{media}`):", ""]
        lines += fields_table(schema or {})
    lines += ["| status | meaning | body |", "|---|---|---|"]
    for status, answer in op.get("responses", {}).items():
        body = ""
        if answer.get("content"):
            media, schema = body_of(answer["content"])
            body = f"`{media}`" + (f": {type_of(schema)}" if schema else "")
        lines.append(f"| {status} | {cell(answer.get('description', ''))} | {cell(body)} |")
    return [*lines, ""]


def page() -> str:
    doc = openapi()
    lines = ["# HTTP API", "",
             f"Every route of queue-gateway {doc['info']['version']}, from the OpenAPI document "
             "it serves at `/openapi.json` (browsable at `/docs` and `/redoc` on a running "
             "gateway, without internet access). What the fields mean and how they work "
             "together: [the contract](../api.md).", "",
             "## Authentication", "", "| scheme | how |", "|---|---|"]
    for name, scheme in doc["components"]["securitySchemes"].items():
        lines.append(f"| {AUTH.get(name, name)} | {cell(scheme.get('description', ''))} |")
    lines.append("")
    placed: set[tuple[str, str]] = set()
    for prefix, title, about in SECTIONS:
        ops = [(m, p, op) for p, item in doc["paths"].items() for m, op in item.items()
               if p.startswith(prefix) and (m, p) not in placed]
        if not ops:
            continue
        lines += [f"## {title}", "", about, ""]
        for method, path, op in ops:
            placed.add((method, path))
            lines += operation(method, path, op)
    lines += ["## Schemas", ""]
    for name, schema in doc["components"]["schemas"].items():
        lines += [f"### {name} {{#{anchor(name)}}}", ""]
        if schema.get("description"):
            lines += [" ".join(schema["description"].split()), ""]
        if "enum" in schema:
            lines += ["One of " + ", ".join(code(v) for v in schema["enum"]) + ".", ""]
        else:
            lines += fields_table(schema)
    return "\n".join(lines)
