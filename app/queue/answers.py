"""A finished call's answer as the task keeps it: its bytes and what describes them.

The bytes stay what the upstream sent. In the task hash (and the SQL row) a body that is text
(valid UTF-8, of a textual type) stays text, as the go-zero clients read
`task_result`; any other is kept in base64 (the Redis connections decode replies as UTF-8, and
the SQL column is text), and one larger than QGW_RESULT_INLINE_BYTES lives in the result store
(app/queue/results.py), the task keeping only its key. What describes the body travels as one
JSON field, `result_meta`, the same in the hash, the row and every reader.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from app.queue.streams import DECODERS

BASE64 = "base64"
EXTERNAL = "external"
#: Content-Encodings the upstream client undoes, and none.
UNDONE = frozenset({"", "identity", *DECODERS})
_TEXT_SUBTYPES = ("json", "xml", "javascript", "x-www-form-urlencoded", "yaml", "csv",
                  "graphql", "x-ndjson")


def textual(content_type: str | None) -> bool:
    """Whether an answer of this type is meant as text (an absent type is taken as text, as
    every answer was before bytes were kept)."""
    if not content_type:
        return True
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime.startswith("text/"):
        return True
    sub = mime.partition("/")[2]
    return any(sub == s or sub.endswith("+" + s) for s in _TEXT_SUBTYPES)


def charset(content_type: str | None) -> str | None:
    """The charset parameter of a Content-Type, if any."""
    for param in (content_type or "").split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"') or None
    return None


@dataclass(frozen=True, slots=True)
class ResultMeta:
    """What the task keeps about its answer besides the inline text."""

    content_type: str | None
    size: int  # bytes of the body, after any Content-Encoding was undone
    encoding: str = ""  # "" = text, BASE64, EXTERNAL
    ref: str | None = None  # the result store's key of an EXTERNAL body
    disposition: str | None = None
    etag: str | None = None
    #: A Content-Encoding the gateway did not undo (it asks for gzip and deflate only; one that
    #: answers `br` anyway): the bytes are kept as sent, and served labelled so.
    coding: str | None = None

    def dumps(self) -> str:
        raw: dict[str, Any] = {"type": self.content_type, "bytes": self.size}
        for name, value in (("enc", self.encoding), ("ref", self.ref),
                            ("disp", self.disposition), ("etag", self.etag),
                            ("ce", self.coding)):
            if value:
                raw[name] = value
        return json.dumps(raw, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str | None) -> ResultMeta | None:
        """The meta of a hash field or row; None when absent (a task finished before bytes
        were kept, or one whose result the gateway wrote: a timeout, an online complete)."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            return cls(d.get("type"), int(d.get("bytes", 0)), d.get("enc", ""), d.get("ref"),
                       d.get("disp"), d.get("etag"), d.get("ce"))
        except (ValueError, TypeError, AttributeError):
            return None


def inline(body: bytes, headers: dict[str, str]) -> tuple[str, ResultMeta]:
    """A body small enough to keep in the task: its text (or base64) and its meta."""
    ctype, coding = headers.get("content-type"), kept_coding(headers)
    text = as_text(body, ctype) if coding is None else None  # encoded bytes are no text
    meta = ResultMeta(ctype, len(body), "" if text is not None else BASE64, None,
                      headers.get("content-disposition"), headers.get("etag"), coding)
    return (text if text is not None else base64.b64encode(body).decode("ascii")), meta


def external(ref: str, size: int, headers: dict[str, str]) -> ResultMeta:
    return ResultMeta(headers.get("content-type"), size, EXTERNAL, ref,
                      headers.get("content-disposition"), headers.get("etag"),
                      kept_coding(headers))


def kept_coding(headers: dict[str, str]) -> str | None:
    """The answer's Content-Encoding if the gateway's client did not undo it."""
    coding = (headers.get("content-encoding") or "").strip()
    return None if coding.lower() in UNDONE else coding


def as_text(body: bytes, content_type: str | None) -> str | None:
    """The body as text when it is valid UTF-8 of a textual type, whatever charset it
    declares; None otherwise (kept in base64). Text in another charset is not kept decoded:
    its encoder does not always give back the bytes its decoder read (UTF-16's BOM and byte
    order, ISO-2022-JP's escape sequences), and a reader of `task_result` expects UTF-8."""
    if not textual(content_type):
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def body_of(text: str | None, meta: ResultMeta | None) -> bytes:
    """The inline body's bytes back from the task's fields (text is kept only when it was
    UTF-8: as_text)."""
    if text is None:
        return b""
    if meta is not None and meta.encoding == BASE64:
        return base64.b64decode(text)
    return text.encode("utf-8")
