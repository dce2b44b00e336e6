"""The relayed answer: the upstream's status and headers at once, then its body a read at a time,
while the caller, the lease and the upstream are watched; whichever ends first ends the call,
and the task is finished (ack-7.lua) whatever the way."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from app import secrets
from app.core.interrupt import Interrupt
from app.proxy.cost import CostReader
from app.proxy.relay import CALLER_LOST, CALLER_STALLED, ProxyCall
from app.queue.http1 import Answer
from app.sending import SendTimeout

log = logging.getLogger(__name__)
#: Answers that never have a body, whatever their Content-Length says (RFC 9110 6.4.1).
BODILESS = frozenset({204, 304})
#: Hop-by-hop headers (RFC 9110 7.6.1) describe the upstream's connection, not the answer;
#: and the gateway's server sets `Date` itself (one only: RFC 9110 6.6.1).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"proxy-authenticate", b"date"})


def relayed_headers(answer: Answer, task_id: str, waited_ms: int) -> list[tuple[bytes, bytes]]:
    raw = answer.raw or []
    named = {v.strip().lower() for n, v in raw if n.lower() == b"connection"
             for v in v.split(b",")}
    if answer.status in BODILESS:  # its length is the representation's, not this answer's
        named.add(b"content-length")  # the caller's server would wait for that many bytes
    # X-Queue-* are the gateway's to say: an upstream's own (a forged task id) are dropped,
    # as a caller's are on the way there.
    out = [(name, v) for n, v in raw if (name := n.lower()) not in HOP_BY_HOP
           and name not in named and not name.startswith(b"x-queue-")]
    out += [(b"x-queue-task-id", task_id.encode()), (b"x-queue-waited-ms", str(waited_ms).encode())]
    return out


class RelayResponse(Response):
    def __init__(self, call: ProxyCall, answer: Answer) -> None:
        assert answer.stream is not None
        self.call, self.answer, self.stream = call, answer, answer.stream
        self.status_code = answer.status
        self.raw_headers = relayed_headers(answer, call.task_id, call.waited_ms)
        self.hider = _hider(call, answer)
        if self.hider is not None:  # its length may change: it goes chunked
            self.raw_headers = [h for h in self.raw_headers if h[0] != b"content-length"]
        self.background = None
        self.ended = False  # the task: once, by the pump before the last bytes, or at the end
        self.acking: asyncio.Future[None] | None = None  # the pump's ack, its reply to come

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.call
        cost = CostReader(call.endpoint.cost_from if call.endpoint.max_cost else None)
        why: str | None = "the relay was cancelled"  # as it stays if a shutdown stops it
        try:
            # The caller leaving or the lease lost (an operator's cancel) stops the relay
            # wherever it waits: for the upstream's next bytes or the caller's socket.
            with Interrupt(call.gone, call.lease_lost) as stop:
                if call.gone.done():  # uvicorn's send would take the answer without a word
                    why = CALLER_LOST
                else:
                    try:
                        await self._pump(send, cost)
                        why = None
                    except Exception as exc:  # the upstream broke off, or the caller's socket
                        why = _failure(exc)
            if stop.by is not None:
                why = CALLER_LOST if stop.by is call.gone else "the lease was lost (cancelled)"
        finally:
            call.lease_lost.cancel()
            call.gone.cancel()
            self.stream.close()  # aborts the upstream's call if it is still on
            status = self.status_code
            try:
                await asyncio.shield(self._finish(why, cost))
                if self.acking is not None:
                    await asyncio.shield(self.acking)
            finally:  # the status went out first; `why` says if the body did not follow
                call.traced(status, why or (f"upstream answered {status}" if status >= 500
                                            else None))

    async def _pump(self, send: Send, cost: CostReader) -> None:
        stream = self.stream
        head: Message = {"type": "http.response.start", "status": self.status_code,
                         "headers": self.raw_headers}
        start: Message | None = head
        if not stream.ready:  # nothing of the body here yet: the head goes at once
            await send(head)
            start = None
        # Otherwise it goes with the first piece (after the ack, when that piece is the last):
        # two writes back to back, which the caller reads at one wake rather than two.
        ending: asyncio.Future[None] | None = None
        hider = self.hider
        async for chunk in stream:
            cost.feed(chunk)
            last = stream.at_end
            if hider is not None:
                chunk = hider.feed(chunk) + (hider.end() if last else b"")
            if last:
                ending = await self._end_first(cost)
            if start is not None:
                await send(start)
                start = None
            # uvicorn's send waits while the caller's socket is backed up: the upstream is
            # read no faster than the caller takes it. The last piece goes with the answer's
            # end (a chunked answer's last chunk and its terminator in one write).
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
        if ending is None:  # an empty body, or one that ended with its connection
            ending = await self._end_first(cost)
            if start is not None:
                await send(start)
            rest = hider.end() if hider is not None else b""
            await send({"type": "http.response.body", "body": rest, "more_body": False})
        # Its reply is awaited by the caller of the pump: with the answer complete, the server
        # tells the request it is over (a disconnect), which must not read as a caller gone.
        self.acking = ending

    async def _end_first(self, cost: CostReader) -> asyncio.Future[None]:
        """The task ends before its caller has the last byte (a Content-Length answer is whole
        then): whoever then asks for its status reads it ended, not still `processing`. Its
        ack is written to Redis here and its reply awaited once the last bytes are on their
        way; first, when it could not be written at once (a Cluster, no connection held)."""
        ending, written = self._end(None, cost)
        task = asyncio.ensure_future(ending)
        if not written:  # its first try, at most: retried through an outage, it goes on
            # behind the last bytes, which a Redis away holds no longer than a command would
            await asyncio.wait({task}, timeout=self.call.rt.settings.redis_timeout_s)
        return task

    async def _finish(self, why: str | None, cost: CostReader) -> None:
        ending, _ = self._end(why, cost)
        await ending

    def _end(self, why: str | None, cost: CostReader) -> tuple[Awaitable[None], bool]:
        """The task's end, once: started now, and whether Redis has its ack already."""
        if self.ended:
            return _nothing(), True
        self.ended = True
        call, status = self.call, self.status_code
        exec_ms = (time.monotonic() - call.call_started) * 1000
        ok = why is None and (200 <= status < 300 or status == 304)  # 304: not modified
        text = why or ("" if ok else f"upstream answered {status}")
        real = self._real_cost(cost) if why is None else None
        acking, written = call.finishing("completed" if ok else "failed", text, status, exec_ms,
                                         real, self.answer.headers)
        return self._logged(acking, why), written

    def _real_cost(self, cost: CostReader) -> int | None:
        """What the answer says it cost; None (the reservation stands) when it cannot be read
        however it fails: the task must end and free its slot whatever the answer held."""
        try:
            return cost.cost(self.answer.headers)
        except Exception:
            log.exception("the answer's cost could not be read",
                          extra={"task_id": self.call.task_id, "endpoint": self.call.endpoint.id})
            return None

    async def _logged(self, acking: Awaitable[bool], why: str | None) -> None:
        acked = await acking
        call = self.call
        if why is not None:
            log.info("proxied call ended early: %s", why,
                     extra={"task_id": call.task_id, "endpoint": call.endpoint.id})
        elif not acked:
            log.warning("lease lost before the proxied call was finished",
                        extra={"task_id": call.task_id, "endpoint": call.endpoint.id})


def _hider(call: ProxyCall, answer: Answer) -> secrets.Hider | None:
    """An error answer goes without the endpoint's credentials it may echo back (a 401 saying
    "key sk-... is not valid"): the caller never holds them. A success goes byte for byte."""
    if 200 <= answer.status < 300 or answer.status in BODILESS or call.method == "HEAD" \
            or answer.headers.get("content-length", "").strip() == "0":
        return None  # no body: its Content-Length stays as it was
    echoed = secrets.echoes(call.endpoint.credentials)
    return secrets.Hider(echoed) if echoed else None


async def _nothing() -> None:
    return None


def _failure(exc: BaseException | None) -> str | None:
    if exc is None:
        return None
    if isinstance(exc, OSError) and "disconnect" in type(exc).__name__.lower():
        return CALLER_LOST
    if isinstance(exc, SendTimeout):  # a write waited QGW_SEND_TIMEOUT_S (app/sending.py)
        return CALLER_STALLED
    if isinstance(exc, TimeoutError):
        return "upstream answer stalled past the endpoint's timeout"
    return f"upstream answer broke off: {type(exc).__name__}: {exc}"
