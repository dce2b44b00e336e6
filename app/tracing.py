"""OpenTelemetry traces of a task's path, off unless an OTLP endpoint is configured.

With `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, and the
other standard `OTEL_*` variables as the SDK reads them, each task makes one trace:

- `submit` (API, SERVER): the POST; its parent is the caller's `traceparent` header (or one
  in the task's own `headers`), and its context is stored with the task as the task's
  `traceparent`/`tracestate` headers, so the dispatcher's spans join the caller's trace;
- `queued` (dispatcher): from the submit (the time in the task's uuid7 id) to the claim;
- `call` (dispatcher, CLIENT): the business API call, with the `http.*` semantic conventions;
  the upstream gets this span's `traceparent`;
- `ack` (dispatcher): the task's end written to Redis (or its retry set aside);
- `outbox` (dispatcher): the SQL transaction that keeps the finished task's record, one span
  per task of the batch (their times are the batch's).

A proxied request (`/proxy/...`, app/proxy/) is one `proxy` span (API, SERVER) over the whole
relay: from the request read, through its wait in line, to its answer's last byte and the
task's end; its parent is the caller's `traceparent`, and the upstream gets this span's context.

Unset, nothing is imported or allocated: the hot paths test the module-level ENABLED.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from app import __version__, logs

ENABLED = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
               or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) and (
    os.environ.get("OTEL_SDK_DISABLED", "").lower() != "true")
_CONTEXT_HEADERS = ("traceparent", "tracestate")
_provider: Any = None


def setup(role: str) -> None:
    """The exporting tracer provider of this process (once; a no-op when off)."""
    global _provider
    if not ENABLED or _provider is not None:
        return
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                               "queue-gateway"),
                                "service.version": __version__, "qgw.role": role,
                                "process.pid": os.getpid()})
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)


def shutdown() -> None:
    """Send what is buffered (a stopping process's last spans)."""
    if _provider is not None:
        _provider.shutdown()


def _tracer() -> Any:
    from opentelemetry import trace

    return trace.get_tracer("queue-gateway", __version__)


def _context_of(carrier: Mapping[str, str]) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def _carrier(span: Any) -> dict[str, str]:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    out: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(out, trace.set_span_in_context(span))
    return out


def _first(headers: Mapping[str, list[str]], name: str) -> str | None:
    for key, values in headers.items():
        if key.lower() == name and values:
            return values[0]
    return None


@contextmanager
def submit_span(http_headers: Mapping[str, str], task_headers: dict[str, list[str]],
                route: str) -> Iterator[Any]:
    """The `submit` span, child of the caller's context; the task's headers get its own."""
    carrier = {k: v for k in _CONTEXT_HEADERS if (v := http_headers.get(k))}
    if "traceparent" not in carrier:  # a caller that put its context in the task's headers
        carrier = {k: v for k in _CONTEXT_HEADERS if (v := _first(task_headers, k))}
    from opentelemetry.trace import SpanKind

    with _tracer().start_as_current_span(
            "submit", context=_context_of(carrier), kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route}) as span:
        for key in [k for k in task_headers if k.lower() in _CONTEXT_HEADERS]:
            del task_headers[key]
        task_headers.update({k: [v] for k, v in _carrier(span).items()})
        yield span


def _task_context(headers_json: str) -> Any:
    headers = json.loads(headers_json or "{}")
    return _context_of({k: v for k in _CONTEXT_HEADERS if (v := _first(headers, k))})


def _uuid7_ns(task_id: str) -> int | None:
    """When the task was submitted: the first 48 bits of its uuid7 id, in ms."""
    try:
        return int(task_id[:12], 16) * 1_000_000
    except ValueError:
        return None


class TaskTrace:
    """A claimed task's spans in the dispatcher, children of its `submit` span."""

    def __init__(self, task_id: str, endpoint: str, headers_json: str, attempt: int) -> None:
        from opentelemetry.trace import SpanKind

        self.parent = _task_context(headers_json)
        self.attributes = {"qgw.task_id": task_id, "qgw.endpoint": endpoint,
                           "qgw.attempt": attempt}
        self.kind = SpanKind
        if attempt == 1 and (submitted := _uuid7_ns(task_id)) is not None:
            queued = _tracer().start_span("queued", context=self.parent, start_time=submitted,
                                          attributes=self.attributes)
            queued.end(end_time=max(submitted, time.time_ns()))

    @contextmanager
    def call(self, method: str, url: str) -> Iterator[tuple[Any, dict[str, str]]]:
        """The `call` span and the trace headers the upstream gets."""
        from yarl import URL

        u = URL(url)
        with _tracer().start_as_current_span(
                "call", context=self.parent, kind=self.kind.CLIENT, attributes={
                    **self.attributes, "http.request.method": method, "url.full": url,
                    "server.address": u.host or "", "server.port": u.port or 0}) as span:
            yield span, _carrier(span)

    @staticmethod
    def answered(span: Any, status_code: int | None, problem: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        if status_code is not None:
            span.set_attribute("http.response.status_code", status_code)
        if status_code is None or status_code >= 400:
            span.set_attribute("error.type", str(status_code) if status_code else "timeout"
                               if "timed out" in problem else "connection")
            span.set_status(Status(StatusCode.ERROR, logs.clipped(problem, 200)))

    @contextmanager
    def ack(self, name: str) -> Iterator[Any]:
        with _tracer().start_as_current_span(name, context=self.parent,
                                             attributes=self.attributes) as span:
            yield span


def outbox_spans(endpoint: str, db_system: str, contexts: Mapping[str, str | None],
                 start_ns: int) -> None:
    """The `outbox` spans of one committed batch: each task's, in its own trace (its stored
    headers hold the `submit` span's context), ending now."""
    end_ns = time.time_ns()
    tracer = _tracer()
    for task_id, headers_json in contexts.items():
        span = tracer.start_span("outbox", context=_task_context(headers_json or ""),
                                 start_time=start_ns, attributes={
                                     "qgw.task_id": task_id, "qgw.endpoint": endpoint,
                                     "db.system": db_system, "db.operation.name": "upsert",
                                     "qgw.batch_tasks": len(contexts)})
        span.end(end_time=end_ns)


def with_headers(headers_json: str, trace_headers: dict[str, str]) -> str:
    """The task's stored headers with the call span's context in place of the submit's."""
    headers = {k: v for k, v in json.loads(headers_json or "{}").items()
               if k.lower() not in _CONTEXT_HEADERS}
    headers.update({k: [v] for k, v in trace_headers.items()})
    return json.dumps(headers)


class ProxyTrace:
    """The `proxy` span of a proxied request: started once it is read, ended with the relay."""

    def __init__(self, http_headers: Mapping[str, str], method: str, url: str,
                 endpoint: str) -> None:
        from opentelemetry.trace import SpanKind
        from yarl import URL

        carrier = {k: v for k in _CONTEXT_HEADERS if (v := http_headers.get(k))}
        u = URL(url)
        self.span = _tracer().start_span(
            "proxy", context=_context_of(carrier), kind=SpanKind.SERVER, attributes={
                "qgw.endpoint": endpoint, "http.request.method": method,
                "http.route": "/proxy/{endpoint_id}/{path}", "url.full": url,
                "server.address": u.host or "", "server.port": u.port or 0})

    def outgoing(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The upstream's headers with this span's context in place of the caller's."""
        kept = [(n, v) for n, v in headers if n.lower() not in _CONTEXT_HEADERS]
        return kept + list(_carrier(self.span).items())

    def task(self, task_id: str, waited_ms: int) -> None:
        self.span.set_attributes({"qgw.task_id": task_id, "qgw.waited_ms": waited_ms})

    def end(self, status_code: int | None, problem: str | None) -> None:
        """Once: the status the caller got (None: none, the connection was lost) and what
        went wrong, if anything."""
        from opentelemetry.trace import Status, StatusCode

        span = self.span
        if not span.is_recording():
            return
        if status_code is not None:
            span.set_attribute("http.response.status_code", status_code)
        if problem is not None or status_code is None or status_code >= 500:
            span.set_attribute("error.type", str(status_code) if status_code else "connection")
            span.set_status(Status(StatusCode.ERROR, logs.clipped(problem or "", 200)))
        span.end()
