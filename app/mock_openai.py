"""The OpenAI wire format for `qgw mock-upstream --openai`: `POST /v1/chat/completions` (JSON,
or with `"stream": true` server-sent events ending `data: [DONE]`, and a last usage event when
`stream_options.include_usage`) and `POST /v1/embeddings` (floats, or base64 as the official SDK
asks by default). What the official `openai` SDK parses, no more: enough to drive it through the
gateway in tests, walk-throughs and benchmarks.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from typing import Any

Send = Any
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache")]
EMBEDDING_DIMS = 8
RATE_LIMITED = {"error": {"message": "Rate limit reached for requests", "type": "requests",
                          "param": None, "code": "rate_limit_exceeded"}}


def is_openai_path(path: str) -> bool:
    return path.rstrip("/").endswith(("/chat/completions", "/embeddings"))


def _words(value: Any) -> int:
    """A stand-in for a tokenizer: the words of every string in the request but roles."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(v) for v in value)
    if isinstance(value, dict):
        return sum(_words(v) for k, v in value.items() if k != "role")
    return 0


def request_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


async def answer(path: str, body: bytes, n: int, chunks: int, chunk_ms: float,
                 send: Send, extra: list[tuple[bytes, bytes]]) -> None:
    """Answer request number `n` (its id) at `path`."""
    req = request_json(body)
    if path.rstrip("/").endswith("/embeddings"):
        await send_json(send, 200, embeddings(req), extra)
    elif req.get("stream"):
        await _stream_chat(send, req, n, chunks, chunk_ms, extra)
    else:
        await send_json(send, 200, _chat(req, n, chunks), extra)


def _usage(req: dict[str, Any], completion: int) -> dict[str, int]:
    prompt = _words(req.get("messages", req.get("input", "")))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _chat(req: dict[str, Any], n: int, chunks: int) -> dict[str, Any]:
    text = " ".join(f"tok{i}" for i in range(chunks))
    return {
        "id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()),
        "model": req.get("model", "mock"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": "stop", "logprobs": None}],
        "usage": _usage(req, chunks),
    }


def _event(n: int, model: str, delta: dict[str, Any], finish: str | None) -> bytes:
    chunk = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk",
             "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def _stream_chat(send: Send, req: dict[str, Any], n: int, chunks: int, chunk_ms: float,
                       extra: list[tuple[bytes, bytes]]) -> None:
    model = str(req.get("model", "mock"))
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + extra})
    if chunk_ms:  # as the API does: its headers at once, its first event when the model starts
        await asyncio.sleep(chunk_ms / 1000)
    await send({"type": "http.response.body", "more_body": True,
                "body": _event(n, model, {"role": "assistant", "content": ""}, None)})
    for i in range(chunks):
        if chunk_ms:
            await asyncio.sleep(chunk_ms / 1000)
        await send({"type": "http.response.body", "more_body": True,
                    "body": _event(n, model, {"content": f"tok{i} "}, None)})
    tail = _event(n, model, {}, "stop")
    if (req.get("stream_options") or {}).get("include_usage"):
        usage = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk",
                 "created": int(time.time()), "model": model, "choices": [],
                 "usage": _usage(req, chunks)}
        tail += b"data: " + json.dumps(usage).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})


def embeddings(req: dict[str, Any]) -> dict[str, Any]:
    raw = req.get("input", "")
    inputs = raw if isinstance(raw, list) else [raw]
    data = []
    for i, text in enumerate(inputs):
        vector = [((len(str(text)) + i + d) % 8) / 8 for d in range(EMBEDDING_DIMS)]
        value: Any = vector  # eighths: exact in float32, as base64 carries them
        if req.get("encoding_format") == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": i, "embedding": value})
    usage = _usage(req, 0)
    return {"object": "list", "data": data, "model": req.get("model", "mock"),
            "usage": {"prompt_tokens": usage["prompt_tokens"],
                      "total_tokens": usage["total_tokens"]}}


async def send_json(send: Send, status: int, payload: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})
