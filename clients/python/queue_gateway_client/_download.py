"""A task's `/result` streamed to a file: the state both clients drive, one request at a time.

The bytes go to a hidden file beside the target (`.<name>.<random>.part`: the same filesystem,
so the final rename is atomic), renamed to the target once all of them have come and been
flushed to disk, removed on any failure: the target is never a truncated answer, and a file
already there stays as it was until the new one replaces it whole. A connection cut mid-way is
resumed with `Range: bytes=<have>-` (and `If-Range: <ETag>` when the answer had a strong one);
what comes back is written only when it is a 206 whose `Content-Range` starts where the file
ends, with the same total and ETag; otherwise the download starts again from zero. A target
that is a pipe or a device (`/dev/stdout`) is written in place, having no name to protect."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import httpx

from queue_gateway_client._common import ApiError, QueueGatewayError

#: What one read takes from the socket and one write puts in the file: what a download holds
#: in memory, whatever the answer's size.
CHUNK = 256 << 10
#: The answers a download reads itself; any other is retried (429, 503) or raised.
READ = frozenset({200, 206, 416})
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$", re.ASCII | re.IGNORECASE)


class Download:
    """One download of `/result` to `target`: its part file, how much of the answer it holds,
    and what the first answer said the whole is (its length, its ETag)."""

    def __init__(self, target: Path) -> None:
        if target.is_dir():  # found now, not by the rename once the whole answer has come
            raise IsADirectoryError(f"{target} is a directory: name the file to write")
        self.target = target
        # Through a symbolic link, the file it names is replaced (as a write would), not the link.
        self._dest = target.resolve() if target.is_symlink() else target
        # A pipe or a device (/dev/stdout) is written in place: renaming a file onto it would
        # replace it, and it has no truncated state to keep a name from.
        self._in_place = target.exists() and not target.is_file()
        if self._in_place:
            self.part, self._file = target, target.open("wb")
        else:
            self.part = self._dest.with_name(f".{self._dest.name}.{secrets.token_hex(4)}.part")
            self._file = self.part.open("xb")  # x: never someone else's file of that name
        self.have = 0
        self.total: int | None = None
        self.etag: str | None = None
        self._longest = 0  # the most the file has held: a try that passes it made progress

    @property
    def complete(self) -> bool:
        return self.total is not None and self.have == self.total

    def headers(self) -> dict[str, str]:
        """The next request's headers: the rest of the answer, once some of it is here."""
        # The bytes as stored, never compressed on the way: lengths and ranges count them.
        headers = {"Accept-Encoding": "identity"}
        if self.have:
            headers["Range"] = f"bytes={self.have}-"
            # If-Range takes a strong validator only (RFC 9110 13.1.5); a weak one is still
            # compared below.
            if self.etag and not self.etag.startswith("W/"):
                headers["If-Range"] = self.etag
        return headers

    def start(self, r: httpx.Response) -> bool:
        """Whether `r`'s body is what the file lacks: a 200 (the whole answer: the file is
        emptied first) or the 206 asked for. False for anything else (a 206 of another range,
        total or ETag, a 416): the answer changed, or the range was not understood; the file
        is emptied and the next request asks for the whole answer."""
        if r.headers.get("content-encoding", "identity").lower() != "identity":
            raise QueueGatewayError(f"/result came {r.headers['content-encoding']}-encoded "
                                    "though asked for as is: its bytes cannot be counted")
        if r.status_code == 200:
            self._restart()
            self.total, self.etag = _length(r), r.headers.get("etag")
            return True
        if r.status_code == 206 and self._continues(r):
            return True
        if r.status_code not in READ:  # a 204, a 3xx: nothing /result answers
            raise ApiError(r.status_code, "unexpected_answer", f"GET {r.url.path} answered "
                           f"{r.status_code}, not the result's bytes")
        self._restart()
        self.total = self.etag = None
        return False

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self.have += len(chunk)

    def ended(self) -> None:
        """The answer ended cleanly. Without a length, what came is the whole; with one, a
        shorter body leaves the download incomplete (the next request resumes it)."""
        if self.total is None:
            self.total = self.have
        elif self.have > self.total:
            raise QueueGatewayError(f"/result sent {self.have} bytes of a {self.total}-byte "
                                    "answer")

    def progressed(self) -> bool:
        """Whether the file holds more than it ever did: a try that cut off after gaining
        bytes does not use up a retry, one that gained none (or started over) does."""
        if self.have > self._longest:
            self._longest = self.have
            return True
        return False

    def commit(self) -> Path:
        """The complete file, flushed to disk, renamed to the target."""
        self._file.flush()
        if not self._in_place:
            os.fsync(self._file.fileno())  # else a crash could leave the new name on no data
            os.replace(self.part, self._dest)
        self._file.close()
        return self.target

    def discard(self) -> None:
        """Remove the part file (nothing once committed)."""
        self._file.close()
        if not self._in_place:
            self.part.unlink(missing_ok=True)

    def _continues(self, r: httpx.Response) -> bool:
        m = CONTENT_RANGE.match(r.headers.get("content-range", ""))
        if m is None or int(m[1]) != self.have or m[3] == "*":
            return False
        total, etag = int(m[3]), r.headers.get("etag")
        if self.have and (total != self.total or etag != self.etag):
            return False  # not the answer the file began with (retried by an operator?)
        self.total, self.etag = total, etag
        return True

    def _restart(self) -> None:
        if self.have and self._in_place:
            raise QueueGatewayError(f"the answer must be read again from its start, and "
                                    f"{self.target} cannot be rewound")
        if self.have:
            self._file.seek(0)
            self._file.truncate()
            self.have = 0


def _length(r: httpx.Response) -> int | None:
    try:
        return int(r.headers["content-length"])
    except (KeyError, ValueError):
        return None


def gave_up(url: str, dl: Download, cause: BaseException | None) -> str:
    """GatewayUnreachable's message once the retries are spent."""
    total = "?" if dl.total is None else dl.total
    return f"GET {url}: {cause or 'the answer ended early'!r} ({dl.have} of {total} bytes)"
