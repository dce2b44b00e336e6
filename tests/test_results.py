"""Results as the upstream sent them: bytes and type kept, `/result`, ranges (app/queue/answers.py,
app/routes/results.py), inline and in the `file://` result store."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from app.mock_upstream import binary_body
from app.runtime import Runtime
from app.settings import Settings
from tests.conftest import Gateway

pytestmark = pytest.mark.backends("single", "cluster")
MB = 1_000_000


def expected(size: int, seed: int = 0) -> bytes:
    return b"".join(binary_body(size, seed))


def stored_files(settings: Settings) -> list[Path]:
    root = settings.data_dir / "results"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


async def run_one(gateway: Gateway, start: Callable[[], Awaitable[Runtime]], upstream: str,
                  path: str, **submit: Any) -> tuple[dict[str, str], dict[str, Any]]:
    await gateway.add_endpoint(path.strip("/"), f"{upstream}{path}", max_retries=2,
                               retry_backoff_ms=50, timeout_ms=60_000)
    auth = await gateway.new_key()
    task = await gateway.submit(auth, f"{upstream}{path}", **submit)
    await start()
    (done,) = await gateway.wait_finished(auth, [task["task_id"]], timeout=60)
    return auth, done


class TestInline:
    @pytest.fixture
    def settings(self, settings: Settings) -> Settings:
        return settings.model_copy(update={"result_inline_bytes": 2 << 20})

    async def test_a_binary_answer_comes_back_byte_exact_in_json_and_through_result(
        self, gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
    ) -> None:
        auth, done = await run_one(gateway, start_dispatcher, upstream, "/png",
                                   headers={"X-Mock-Binary": [f"{MB};seed=7"]})
        want = expected(MB, 7)
        assert done["task_status"] == "completed" and done["result_status_code"] == 200
        assert done["result_encoding"] == "base64"
        assert done["result_content_type"] == "image/png" and done["result_bytes"] == MB
        assert base64.b64decode(done["task_result"]) == want
        r = await gateway.http.get(f"/api/v1/tasks/{done['task_id']}/result", headers=auth)
        assert r.status_code == 200 and r.content == want
        assert r.headers["content-type"] == "image/png"
        assert r.headers["x-queue-result-status"] == "200"
        assert r.headers["etag"] == f'"{MB}-7"'
        assert r.headers["content-disposition"] == 'attachment; filename="out.bin"'
        assert r.headers["x-content-type-options"] == "nosniff"
        assert stored_files(gateway.rt.settings) == []  # inline: nothing in the store

    async def test_ranges_of_an_inline_answer(
        self, gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
    ) -> None:
        auth, done = await run_one(gateway, start_dispatcher, upstream, "/rng",
                                   headers={"X-Mock-Binary": ["5000;seed=3"]})
        await _check_ranges(gateway, auth, done["task_id"], expected(5000, 3))

    async def test_a_malformed_range_is_ignored_or_416_never_500(
        self, gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
    ) -> None:
        auth, done = await run_one(gateway, start_dispatcher, upstream, "/badrange",
                                   headers={"X-Mock-Binary": ["5000;seed=3"]})
        url, want = f"/api/v1/tasks/{done['task_id']}/result", expected(5000, 3)
        for header in ("bytes=" + "9" * 5000 + "-", "bytes=-" + "9" * 5000, "bytes=0-" + "9" * 200,
                       "bytes=x-y", "items=0-5", "bytes=5-3", "bytes=0-1,5-6", "bytes=-",
                       "bytes=٣-"):
            r = await gateway.http.get(url, headers={**auth, "Range": header.encode("utf-8")})  # type: ignore[arg-type]  # httpx takes bytes values
            assert r.status_code == 200 and r.content == want, header[:20]
        r = await gateway.http.get(url, headers={**auth, "Range": "BYTES = 10-19"})
        assert r.status_code == 206 and r.content == want[10:20]
        for header in ("bytes=-0", "bytes=" + "9" * 80 + "-"):
            r = await gateway.http.get(url, headers={**auth, "Range": header})
            assert r.status_code == 416 and r.headers["content-range"] == "bytes */5000"
        # If-Range: the range only for the answer whose ETag it names, else the whole answer.
        etag = r.headers["etag"]
        for validator, code in ((etag, 206), ('"another"', 200), ("W/" + etag, 200),
                                ("Wed, 21 Oct 2015 07:28:00 GMT", 200)):
            r = await gateway.http.get(url, headers={**auth, "Range": "bytes=10-19",
                                                     "If-Range": validator})
            assert r.status_code == code, validator
            assert r.content == (want[10:20] if code == 206 else want), validator

    @pytest.mark.parametrize("ctype, body, encoding", [
        ("text/plain; charset=utf-16", b"\xfe\xff" + "héllo".encode("utf-16-be"), "base64"),
        # 7-bit bytes, so valid UTF-8: kept as that text, which gives the same bytes back
        ("text/plain; charset=iso-2022-jp", b"\x1b(B" + "日本".encode("iso-2022-jp"), None),
        ("text/plain; charset=iso-8859-1", b"caf\xe9", "base64"),
    ])
    async def test_text_in_another_charset_comes_back_byte_exact(
        self, gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
        ctype: str, body: bytes, encoding: str | None,
    ) -> None:
        auth, done = await run_one(gateway, start_dispatcher, upstream, "/charset", headers={
            "X-Mock-Body-Base64": [base64.b64encode(body).decode()],
            "X-Mock-Reply-Headers": [json.dumps({"Content-Type": ctype})]})
        assert done["result_content_type"] == ctype and done["result_bytes"] == len(body)
        assert done["result_encoding"] == encoding  # not UTF-8: never kept as decoded text
        assert (base64.b64decode(done["task_result"]) if encoding else
                done["task_result"].encode()) == body
        r = await gateway.http.get(f"/api/v1/tasks/{done['task_id']}/result", headers=auth)
        assert r.status_code == 200 and r.content == body

    @pytest.mark.parametrize("reply, disposition", [
        ({"Content-Type": "text/html; charset=utf-8"}, "attachment"),
        ({"Content-Type": "IMAGE/SVG+XML"}, "attachment"),
        ({"Content-Type": "application/xhtml+xml"}, "attachment"),
        ({"Content-Type": "text/xml"}, "attachment"),
        ({"Content-Type": "image/svg+xml", "Content-Disposition": "inline"}, "inline"),
        ({"Content-Type": "text/plain"}, None),
    ])
    async def test_upstream_bytes_are_served_confined(
        self, gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
        reply: dict[str, str], disposition: str | None,
    ) -> None:
        """Served from our origin: never sniffed, never run as our page; a document type is
        downloaded unless the upstream said otherwise."""
        body = b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)</script></svg>"
        auth, done = await run_one(gateway, start_dispatcher, upstream, "/active", headers={
            "X-Mock-Body-Base64": [base64.b64encode(body).decode()],
            "X-Mock-Reply-Headers": [json.dumps(reply)]})
        r = await gateway.http.get(f"/api/v1/tasks/{done['task_id']}/result", headers=auth)
        assert r.status_code == 200 and r.content == body
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["content-security-policy"] == "sandbox"
        assert r.headers.get("content-disposition") == disposition

    async def test_an_encoding_not_undone_is_kept_and_served_with_the_bytes(
        self, gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
    ) -> None:
        """The gateway asks for gzip or deflate and undoes them; an upstream that answers in
        another coding anyway (`br`) has its bytes kept as sent, never as text, and /result
        labels them so (they went out unlabelled, as JSON no client could read)."""
        body = b"\x1b\x0b\x00\xf8\xa5@\xc2\xaa\x93\x8d"  # what brotli makes of a JSON
        auth, done = await run_one(gateway, start_dispatcher, upstream, "/brotli", headers={
            "X-Mock-Body-Base64": [base64.b64encode(body).decode()],
            "X-Mock-Reply-Headers": [json.dumps({"Content-Type": "application/json",
                                                 "Content-Encoding": "br"})]})
        assert done["result_encoding"] == "base64" and done["result_bytes"] == len(body)
        assert base64.b64decode(done["task_result"]) == body
        url = f"/api/v1/tasks/{done['task_id']}/result"
        async with gateway.http.stream("GET", url, headers=auth) as r:
            raw = b"".join([piece async for piece in r.aiter_raw()])
        assert r.status_code == 200 and raw == body
        assert r.headers["content-encoding"] == "br"
        assert r.headers["content-type"] == "application/json"

    async def test_a_json_answer_stays_text(
        self, gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
    ) -> None:
        auth, done = await run_one(gateway, start_dispatcher, upstream, "/json", body="hi")
        assert done["result_encoding"] is None
        assert json.loads(done["task_result"])["echo"] == "hi"
        assert done["result_content_type"] == "application/json"
        assert done["result_bytes"] == len(done["task_result"].encode())
        r = await gateway.http.get(f"/api/v1/tasks/{done['task_id']}/result", headers=auth)
        assert r.status_code == 200 and r.json()["echo"] == "hi"
        assert r.headers["content-type"] == "application/json"


async def test_a_large_answer_goes_to_the_file_store_and_streams_back(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
) -> None:
    auth, done = await run_one(gateway, start_dispatcher, upstream, "/big",
                               headers={"X-Mock-Binary": [f"{3 * MB};seed=5"]})
    want = expected(3 * MB, 5)
    assert done["task_status"] == "completed", done
    assert done["task_result"] is None and done["result_encoding"] == "external"
    assert done["result_bytes"] == 3 * MB and done["result_content_type"] == "image/png"
    (obj,) = stored_files(gateway.rt.settings)
    assert obj.stat().st_size == 3 * MB and done["task_id"] in str(obj)
    r = await gateway.http.get(f"/api/v1/tasks/{done['task_id']}/result", headers=auth)
    assert r.status_code == 200 and hashlib.sha256(r.content).digest() == \
        hashlib.sha256(want).digest()
    assert r.headers["content-length"] == str(3 * MB)
    await _check_ranges(gateway, auth, done["task_id"], want)


async def test_no_result_is_409_with_the_status(gateway: Gateway, upstream: str) -> None:
    await gateway.add_endpoint("wait", f"{upstream}/wait")
    auth = await gateway.new_key()
    task = await gateway.submit(auth, f"{upstream}/wait")
    r = await gateway.http.get(f"/api/v1/tasks/{task['task_id']}/result", headers=auth)
    assert r.status_code == 409 and r.json()["error"]["task_status"] == "pending"
    other = await gateway.new_key(user_id=2)
    r = await gateway.http.get(f"/api/v1/tasks/{task['task_id']}/result", headers=other)
    assert r.status_code == 404


class TestLimit:
    @pytest.fixture
    def settings(self, settings: Settings) -> Settings:
        return settings.model_copy(update={"max_result_bytes": 2 << 20})

    async def test_an_answer_over_the_limit_fails_at_once_and_leaves_nothing(
        self, gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]]
    ) -> None:
        # Announced by its Content-Length: refused before a byte is stored.
        _, done = await run_one(gateway, start_dispatcher, upstream, "/over",
                                headers={"X-Mock-Binary": [f"{3 * MB};seed=1"]})
        assert done["task_status"] == "failed" and done["attempts"] == 1
        assert "over" in done["task_result"] and stored_files(gateway.rt.settings) == []


async def _check_ranges(gateway: Gateway, auth: dict[str, str], tid: str, want: bytes) -> None:
    url = f"/api/v1/tasks/{tid}/result"
    n = len(want)
    for header, start, end in (("bytes=100-199", 100, 200), ("bytes=-10", n - 10, n),
                               (f"bytes={n - 5}-", n - 5, n), (f"bytes=0-{n * 2}", 0, n)):
        r = await gateway.http.get(url, headers={**auth, "Range": header})
        assert r.status_code == 206, (header, r.status_code)
        assert r.content == want[start:end], header
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{n}"
    r = await gateway.http.get(url, headers={**auth, "Range": f"bytes={n}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{n}"


async def test_the_client_gives_bytes_and_type_and_the_cli_names_them(
    gateway: Gateway, upstream: str, start_dispatcher: Callable[[], Awaitable[Runtime]],
    env: dict[str, str], tmp_path: Path,
) -> None:
    """`Task.result()` is still the `task_result` string, and now carries the bytes (from the
    JSON, or from /result for an external one); `qgw tasks show` prints no binary."""
    from queue_gateway_client import AsyncClient

    from tests.test_cli import answer, aqgw

    url = f"{upstream}/cli"
    await gateway.add_endpoint("cli", url)
    r = await gateway.http.post("/admin/v1/api-keys", headers=gateway.admin, json={"user_id": 1})
    key = r.json()["key"]
    await start_dispatcher()
    async with AsyncClient("http://gateway", key, transport=gateway.http._transport) as client:
        small = await client.submit(url, headers={"X-Mock-Binary": ["1000;seed=2"]})
        large = await client.submit(url, headers={"X-Mock-Binary": [f"{MB};seed=4"]})
        text = await client.submit(url, body="hello")
        got = await small.result(timeout=30)
        assert got.content == expected(1000, 2) and got.content_type == "image/png"
        assert got == base64.b64encode(expected(1000, 2)).decode()  # the str it always was
        big = await large.result(timeout=30)
        assert big.content == expected(MB, 4) and big == ""
        assert big.save(tmp_path / "out.png").read_bytes() == expected(MB, 4)
        plain = await text.result(timeout=30)
        assert plain.json()["echo"] == "hello" and plain.text == plain
    shown = answer(await aqgw(env, "tasks", "show", large.task_id))
    assert shown["task_result"] == (f"<{MB} bytes of image/png: GET /api/v1/tasks/"
                                    f"{large.task_id}/result>")
