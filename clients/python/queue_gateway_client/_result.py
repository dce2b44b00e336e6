"""A finished task's answer: its bytes and type, and the `task_result` string it always was."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any


class Result(str):
    """The business API's answer. As a `str` it is `task_result` as before (the text of a text
    answer); `.content` is its bytes exactly as the upstream sent them, `.text` those bytes as
    text, `.json()` parsed, `.content_type` its type, `.save(path)` writes the bytes."""

    content: bytes
    content_type: str | None
    status_code: int | None

    def __new__(cls, task_result: str, content: bytes, content_type: str | None,
                status_code: int | None) -> Result:
        self = super().__new__(cls, task_result)
        self.content, self.content_type, self.status_code = content, content_type, status_code
        return self

    @property
    def text(self) -> str:
        return self.content.decode(_charset(self.content_type) or "utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.write_bytes(self.content)
        return out


def needs_download(raw: dict[str, Any]) -> bool:
    """Whether the bytes must come from `/result`: a body the JSON does not carry (external),
    or text in a charset its bytes cannot be rebuilt from with certainty."""
    if raw.get("result_encoding") == "external":
        return True
    cs = _charset(raw.get("result_content_type"))
    return raw.get("result_encoding") is None and cs is not None and \
        cs.lower().replace("_", "-") not in ("utf-8", "utf8")


def from_status(raw: dict[str, Any], downloaded: bytes | None) -> Result:
    """The Result of a completed task's status JSON (and `/result`'s bytes when downloaded)."""
    text = raw.get("task_result") or ""
    if downloaded is not None:
        content = downloaded
    elif raw.get("result_encoding") == "base64":
        content = base64.b64decode(text)
    else:
        content = text.encode("utf-8")
    return Result(text, content, raw.get("result_content_type"), raw.get("result_status_code"))


def _charset(content_type: str | None) -> str | None:
    for param in (content_type or "").split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"') or None
    return None
