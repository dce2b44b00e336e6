"""The result store: answers too large to keep in a task, as objects (`file://` or `s3://`).

Why obstore (the `obstore` package, Rust's object_store crate): one async API serves the local
filesystem and any S3-compatible service alike, so `file://` (the embedded default, needing
nothing) and `s3://` (production) run the same code, tested on both. It uploads an async
iterator of chunks as a multipart upload with a bounded number of parts in flight (the body
never sits whole in memory), reads ranges back as a stream, and signs URLs for a redirect.
Its wheels are self-contained (no C toolchain, no boto stack); aiobotocore would have brought
botocore's ~80 MB and its per-request overhead for the same three calls. What it lacks is
listing and aborting multipart uploads a killed process left behind: app/queue/uploads.py
makes those two S3 requests itself.

An object's key is `<task id>/<random>`: each attempt writes its own, so an attempt that lost
its lease never overwrites the answer of the one that won, and the sweep
(app/lifecycle/orphans.py) knows from the key which task an object belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, S3Store

from app.queue.uploads import StoreUnavailable as StoreUnavailable  # theirs to import here
from app.queue.uploads import abort_uploads_of

log = logging.getLogger(__name__)
PART_BYTES = 5 << 20  # an S3 part (5 MiB at least); two in flight bound an upload's memory
PARTS_IN_FLIGHT = 2
READ_CHUNK = 64 << 10  # what a read hands on at a time: about what a stalled reader pins
SIGNED_S = 300  # how long a presigned URL (`/result?redirect=1`) stays valid
SIGNED_MARGIN_S = 60  # a download that began just before its URL expired, to finish
MIN_SIGNED_S = 30  # a shorter-lived URL is not handed out: the bytes are served instead
LIST_BATCH = 1000  # objects a listing hands on at a time (S3 pages hold 1,000 keys)
#: The longest a store may take to answer one request (a read's head, each piece of its body,
#: a delete, a listing's page) before it reads as unavailable. Its client waits up to a day
#: (a download may be long), so without this a store that stops answering held a caller's
#: read, a call's clean-up and its slot for as long.
STORE_OP_S = 10.0


@dataclass(frozen=True, slots=True)
class StoredObject:
    key: str
    size: int
    modified: datetime


class ObjectStore:
    """Objects of results under one `file://` directory or `s3://bucket/prefix`."""

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        self.s3 = parts.scheme == "s3"
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.store: Any
        self.root: Path | None = None  # the directory of a file:// store
        if self.s3:
            endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
            options: dict[str, Any] = {"timeout": "24h", "connect_timeout": "5s"}
            if endpoint and endpoint.startswith("http://"):
                options["allow_http"] = True
            config: Any = {"endpoint": endpoint} if endpoint else None
            self.store = S3Store(parts.netloc, prefix=self.prefix or None, config=config,
                                 client_options=options,  # type: ignore[arg-type]
                                 retry_config={"max_retries": 2,
                                               "retry_timeout": timedelta(seconds=10)})
        else:
            self.root = Path(parts.path)
            # Only the gateway's user may read the answers (one existing is left as it is).
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            # A task's directory goes with its last object: none is left per task ever run.
            self.store = LocalStore(self.root, automatic_cleanup=True)

    @staticmethod
    def new_key(task_id: str) -> str:
        return f"{task_id}/{secrets.token_hex(8)}"

    async def put(self, key: str, chunks: AsyncIterable[bytes], content_type: str | None,
                  content_encoding: str | None = None) -> None:
        """Write `chunks` as the object `key`, part by part as they come. An error of the
        store is StoreUnavailable; one raised by `chunks` passes through; either way no
        object is left (a multipart upload is aborted, else the sweep takes it). On S3 the
        object keeps its type and coding, for a presigned download."""
        attrs: Any = {name: value for name, value in (("Content-Type", content_type),
                                                      ("Content-Encoding", content_encoding))
                      if value} if self.s3 else None
        attrs = attrs or None
        producer = _Producer(chunks)
        try:
            await obstore.put_async(self.store, key, producer, attributes=attrs,
                                    use_multipart=True, chunk_size=PART_BYTES,
                                    max_concurrency=PARTS_IN_FLIGHT)
        except BaseException as exc:  # a timeout's cancellation too: nothing half-written
            with contextlib.suppress(TimeoutError):  # the sweep's, from a store gone quiet
                await asyncio.shield(asyncio.wait_for(
                    self._unwritten(key, cancelled=not isinstance(exc, Exception)),
                    STORE_OP_S))
            if producer.failed is not None:  # the body's own error (an OSError of the
                raise producer.failed from None  # upstream's connection too): not the store's
            if isinstance(exc, Exception) and _ours(exc):
                raise StoreUnavailable(f"{type(exc).__name__}: {exc}"[:500]) from exc
            raise

    async def read(self, key: str, start: int = 0, end: int | None = None
                   ) -> AsyncIterator[bytes]:
        """The object's bytes from `start` to `end` (exclusive), in chunks; raises
        StoreUnavailable (or FileNotFoundError for an object that is gone) before the
        first chunk, so a route can still answer with an error."""
        options: Any = {}
        if start or end is not None:
            options["range"] = (start, end) if end is not None else {"offset": start}
        try:
            async with asyncio.timeout(STORE_OP_S):
                res = await obstore.get_async(self.store, key, options=options or None)
        except (NotFoundError, FileNotFoundError) as exc:
            raise FileNotFoundError(key) from exc
        except Exception as exc:
            raise StoreUnavailable(_said(exc)) from exc
        return _chunks(res.stream(min_chunk_size=READ_CHUNK))

    async def sign(self, key: str, expires_s: int) -> str | None:
        """A presigned GET URL (S3 only; None for `file://`)."""
        if not self.s3:
            return None
        return str(await obstore.sign_async(self.store, "GET", key,
                                            timedelta(seconds=expires_s)))

    async def delete(self, keys: list[str]) -> None:
        """Delete objects; an object already gone is not an error."""
        if not keys:
            return
        try:
            async with asyncio.timeout(STORE_OP_S):
                await obstore.delete_async(self.store, keys)
        except (NotFoundError, FileNotFoundError):
            pass
        except Exception as exc:
            raise StoreUnavailable(_said(exc)) from exc

    async def drop(self, keys: list[str]) -> None:
        """Delete the objects of tasks that are gone, best effort: a store that does not
        answer is logged, and the sweep (app/lifecycle/orphans.py) deletes them later."""
        try:
            await self.delete(keys)
        except StoreUnavailable as exc:
            log.warning("%d result objects not deleted now (%s); the sweep will", len(keys),
                        exc)

    async def _unwritten(self, key: str, cancelled: bool) -> None:
        """Nothing of a put that did not finish is left: its object, and the multipart
        upload of a put cancelled half-way on S3 (obstore aborts only one that failed)."""
        await self.discard(key)
        if cancelled and self.s3:
            full = f"{self.prefix}/{key}" if self.prefix else key
            try:
                await asyncio.to_thread(abort_uploads_of, self.bucket, full)
            except StoreUnavailable as exc:
                log.warning("upload of %s not aborted (%s); the sweep will", key, exc)

    async def discard(self, key: str) -> None:
        """Delete one object if it is there, whatever the store says (a clean-up)."""
        try:
            async with asyncio.timeout(STORE_OP_S):
                await obstore.delete_async(self.store, key)
        except Exception:  # gone already, or the store is down or quiet: the sweep's
            pass

    async def batches(self, older_than_s: float, size: int = LIST_BATCH
                      ) -> AsyncIterator[list[StoredObject]]:
        """The objects last written more than `older_than_s` ago, `size` listed at a time (a
        batch may hold fewer once the young ones are left out): the listing is a stream of
        pages, never the whole store in memory. obstore walks a `file://` directory on its
        own threads, off the event loop; deleting what a batch holds before asking for the
        next one is safe (S3 continues after the last key it gave; a directory walk skips
        what has gone)."""
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
        async for page in _bounded(obstore.list(self.store, chunk_size=size)):
            yield [StoredObject(meta["path"], meta["size"], meta["last_modified"])
                   for meta in page if meta["last_modified"] < cutoff]

    async def listing(self, older_than_s: float) -> AsyncIterator[StoredObject]:
        """Every object last written more than `older_than_s` ago, one at a time."""
        async for batch in self.batches(older_than_s):
            for obj in batch:
                yield obj

    async def check(self) -> None:
        """Raise StoreUnavailable unless the store answers (a read of a key never written)."""
        try:
            async with asyncio.timeout(STORE_OP_S):
                await obstore.head_async(self.store, "_qgw_ready_probe")
        except (NotFoundError, FileNotFoundError):
            return
        except Exception as exc:
            raise StoreUnavailable(_said(exc)) from exc


class _Producer:
    """The chunks of a put, remembering an error they raised. The store's I/O and the
    upstream's connection both raise OSError, so its type cannot say whose an error is: one
    raised while the body was being read is the upstream's (the call failed, and is tried
    again as such), never `result_store_unavailable`."""

    def __init__(self, chunks: AsyncIterable[bytes]) -> None:
        self.chunks = aiter(chunks)
        self.failed: BaseException | None = None

    def __aiter__(self) -> _Producer:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await anext(self.chunks)
        except StopAsyncIteration:
            raise
        except BaseException as exc:
            self.failed = exc
            raise


def _ours(exc: Exception) -> bool:
    """An error of the store (obstore's own, or its I/O), the body's excepted (_Producer)."""
    return type(exc).__module__.startswith("obstore") or isinstance(exc, OSError)


def _said(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {STORE_OP_S:g} s"
    return f"{type(exc).__name__}: {exc}"[:500]


async def _bounded(items: Any) -> AsyncIterator[Any]:
    """What the store sends, a piece at a time (a body's, a listing's pages); a store that
    sends nothing for STORE_OP_S, or fails, has failed the whole."""
    pending = aiter(items)
    while True:
        try:
            async with asyncio.timeout(STORE_OP_S):
                item = await anext(pending)
        except StopAsyncIteration:
            return
        except Exception as exc:
            raise StoreUnavailable(_said(exc)) from exc
        yield item


async def _chunks(stream: Any) -> AsyncIterator[bytes]:
    async for buf in _bounded(stream):
        yield bytes(buf)
