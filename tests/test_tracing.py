"""OpenTelemetry (app/tracing.py) with a real OTLP/HTTP receiver in this process: `qgw api` and
`qgw dispatcher` export protobuf to it, it decodes what they send. One trace per task, the
caller's `traceparent` its parent, the dispatcher's spans children of the API's `submit`
across the two processes, and the upstream called with the `call` span's context. Off (no
OTEL_* endpoint), the SDK is not even imported."""

from __future__ import annotations

import contextlib
import gzip
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import ADMIN
from tests.servers import QGW, free_port, mock_log, stop, wait_port


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    start_ns: int
    end_ns: int


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Receiver:
    """OTLP/HTTP traces receiver (POST /v1/traces, protobuf, gzip or not)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.path == "/v1/traces", self.path
                assert self.headers["Content-Type"] == "application/x-protobuf"
                receiver.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, request: ExportTraceServiceRequest) -> None:
        self.requests += 1
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.kind, {a.key: _value(a.value) for a in s.attributes}, resource,
                        s.start_time_unix_nano, s.end_time_unix_nano))


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


def _wait(check: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.1)


@contextlib.contextmanager
def _traced(env: dict[str, str], receiver: Receiver,
            dispatcher_process: Callable[..., subprocess.Popen[bytes]],
            **otel_env: str) -> Iterator[tuple[str, dict[str, str]]]:
    """`qgw api` and `qgw dispatcher` exporting to the receiver: the API's base URL and the
    admin headers. Both stop on the way out (the dispatcher first), which flushes their spans."""
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
            **otel_env}
    port = free_port()
    api = subprocess.Popen([*QGW, "api", "--port", str(port)], env={**env, **otel},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, 30, api)
        dispatcher = dispatcher_process(**otel)
        yield f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {ADMIN}"}
        stop(dispatcher)
    finally:
        stop(api)


def test_one_trace_per_task_across_api_and_dispatcher(
    env: dict[str, str], receiver: Receiver, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    with _traced(env, receiver, dispatcher_process, OTEL_SERVICE_NAME="qgw-test") as (
            base, admin):
        target = f"{fresh_upstream}/traced"
        assert httpx.post(f"{base}/admin/v1/endpoints", headers=admin, json={
            "id": "traced", "target_url": target}).status_code == 201
        key = httpx.post(f"{base}/admin/v1/api-keys", headers=admin,
                         json={"user_id": 1}).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        joined = httpx.post(f"{base}/api/v1/tasks", json={"target_url": target}, headers={
            **auth, "traceparent": f"00-{caller_trace}-{caller_span}-01"}).json()["task_id"]
        alone = httpx.post(f"{base}/api/v1/tasks", json={"target_url": target},
                           headers=auth).json()["task_id"]
        # Not read while running: a task its owner read skips the outbox (delivered).
        _wait(lambda: sum(s.name == "outbox" for s in receiver.spans) >= 2)
        for tid in (joined, alone):
            assert httpx.get(f"{base}/api/v1/tasks/{tid}", headers=auth
                             ).json()["task_status"] == "completed"
        called = {c["idempotency_key"]: cast("dict[str, str]", c["headers"])
                  for c in mock_log(fresh_upstream)}

    by_task = {tid: [s for s in receiver.spans if s.attributes.get("qgw.task_id") == tid]
               for tid in (joined, alone)}
    for tid, spans in by_task.items():
        names = {s.name: s for s in spans}
        assert set(names) == {"submit", "queued", "call", "ack", "outbox"}, (tid, spans)
        submit = names["submit"]
        assert len({s.trace_id for s in spans}) == 1  # one trace per task
        assert submit.resource["qgw.role"] == "api"
        assert submit.resource["service.name"] == "qgw-test"
        for name in ("queued", "call", "ack", "outbox"):  # children of submit, elsewhere
            s = names[name]
            assert s.parent == submit.span_id, name
            assert s.resource["qgw.role"] == "dispatcher"
            assert s.resource["process.pid"] != submit.resource["process.pid"]
        call = names["call"]
        assert call.kind == 3  # SPAN_KIND_CLIENT
        assert call.attributes["http.request.method"] == "POST"
        assert call.attributes["url.full"] == target
        assert call.attributes["http.response.status_code"] == 200
        assert names["queued"].start_ns <= call.start_ns
        outbox = names["outbox"]  # the SQL write of the finished task, after its ack
        assert outbox.attributes["db.system"] == "sqlite"
        assert names["ack"].start_ns <= outbox.end_ns and outbox.start_ns <= outbox.end_ns
        # The upstream got the call span's context, not the caller's nor the submit's.
        trace_id, parent = called[tid]["traceparent"].split("-")[1:3]
        assert (trace_id, parent) == (call.trace_id, call.span_id)
    joined_submit = next(s for s in by_task[joined] if s.name == "submit")
    assert joined_submit.trace_id == caller_trace and joined_submit.parent == caller_span
    alone_submit = next(s for s in by_task[alone] if s.name == "submit")
    assert alone_submit.parent == "" and alone_submit.trace_id != caller_trace


def test_a_proxied_request_is_one_proxy_span_under_the_callers_trace(
    env: dict[str, str], receiver: Receiver, fresh_upstream: str,
    dispatcher_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """The whole relay (its wait in line, the call, the answer to its last byte) is one `proxy`
    span of the API process, the caller's `traceparent` its parent; the upstream is called
    with the proxy span's context, not the caller's."""
    with _traced(env, receiver, dispatcher_process) as (base, admin):
        assert httpx.post(f"{base}/admin/v1/endpoints", headers=admin, json={
            "id": "relayed", "target_url": f"{fresh_upstream}/v1", "proxy": True,
            "forward_headers": ["X-Mock-Latency-Ms"]}).status_code == 201
        key = httpx.post(f"{base}/admin/v1/api-keys", headers=admin,
                         json={"user_id": 1}).json()["key"]
        caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        time.sleep(1.2)  # the API process hears of the new endpoint
        started = time.time_ns()
        r = httpx.post(f"{base}/proxy/relayed/chat?x=1", content=b"hi", timeout=30, headers={
            "Authorization": f"Bearer {key}", "X-Mock-Latency-Ms": "200",
            "traceparent": f"00-{caller_trace}-{caller_span}-01"})
        ended = time.time_ns()
        assert r.status_code == 200, r.text
        tid = r.headers["x-queue-task-id"]
        (called,) = [c for c in mock_log(fresh_upstream) if c["idempotency_key"] == tid]
        # A quick one: its ack is written while this process still holds its Redis connection,
        # and read after the last bytes, when the server has already told the request it is
        # over; that is no caller gone (its span once said so).
        quick = httpx.post(f"{base}/proxy/relayed/chat", content=b"hi", timeout=30,
                           headers={"Authorization": f"Bearer {key}"})
        assert quick.status_code == 200, quick.text
    _wait(lambda: len([s for s in receiver.spans if s.name == "proxy"]) == 2)

    spans = {s.attributes["qgw.task_id"]: s for s in receiver.spans if s.name == "proxy"}
    assert "error.type" not in spans[quick.headers["x-queue-task-id"]].attributes
    span = spans[tid]
    assert (span.trace_id, span.parent) == (caller_trace, caller_span)
    assert span.kind == 2  # SPAN_KIND_SERVER
    assert span.resource["qgw.role"] == "api"
    a = span.attributes
    assert a["qgw.task_id"] == tid and a["qgw.endpoint"] == "relayed"
    assert a["http.request.method"] == "POST" and a["http.response.status_code"] == 200
    assert a["http.route"] == "/proxy/{endpoint_id}/{path}"
    assert a["url.full"] == f"{fresh_upstream}/v1/chat?x=1"
    assert a["server.address"] == "127.0.0.1" and "error.type" not in a
    assert a["qgw.waited_ms"] >= 0
    # The whole relay: from within the caller's request, the upstream's 200 ms inside it, to
    # the end of the relay, after the answer's last byte went out.
    assert started <= span.start_ns <= ended
    assert span.end_ns - span.start_ns >= 200_000_000
    headers = called["headers"]
    assert isinstance(headers, dict)
    assert headers["traceparent"].split("-")[1:3] == [span.trace_id, span.span_id]


def test_off_by_default_nothing_is_set_up(env: dict[str, str]) -> None:
    """Without an OTLP endpoint no tracer provider or exporter exists: the app is built and
    the dispatcher loaded, `qgw` sets nothing up, and no exporter module is imported (FastAPI
    may import the OpenTelemetry API for its own opt-in telemetry; we add nothing to it)."""
    code = ("import sys; import app.main, app.queue.dispatcher, app.tracing as t; "
            "t.setup('api'); app.main.create_app; "
            "from opentelemetry import trace; "
            "assert not t.ENABLED and t._provider is None; "
            "assert type(trace.get_tracer_provider()).__name__ == 'ProxyTracerProvider'; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.exporter')))")
    clean = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
