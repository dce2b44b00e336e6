"""S3 multipart uploads a killed process left behind, or a put cancelled half-way: listed and
aborted. (StoreUnavailable lives here, below app/queue/objects.py, which uses both.)

obstore aborts an upload that fails in the process, but one cut short by kill -9, or by the
cancellation of its put (its task cancelled, a timeout), stays in the bucket, invisible to
listings and billed, until somebody aborts it; obstore has no call for that. These two
requests (ListMultipartUploads, AbortMultipartUpload) are signed here with AWS Signature V4
and sent with the standard library, off the event loop: a sweep makes a handful an hour, a
cancelled put one, so they need no client of their own. Credentials, region and endpoint
come from the same AWS_* variables obstore reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import urllib.request
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

if TYPE_CHECKING:
    from app.queue.objects import ObjectStore

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
TIMEOUT_S = 10
UPLOADS_PAGE = 1000  # uploads listed per request (S3's own most)


class StoreUnavailable(Exception):
    """The result store did not take or give an object (down, refused, misconfigured)."""


async def abort_stale_uploads(objects: ObjectStore, older_than_s: float,
                              page: int = UPLOADS_PAGE) -> int:
    """Abort the store's multipart uploads begun more than `older_than_s` ago; how many."""
    if not objects.s3:
        return 0
    return await asyncio.to_thread(_abort_stale, objects.bucket, objects.prefix, older_than_s,
                                   page)


def _abort_stale(bucket: str, prefix: str, older_than_s: float, page: int) -> int:
    """Page after page to the end of the listing (uploads under way may fill the first pages:
    the stale ones after them are reached all the same). Some servers' markers skip entries
    (SeaweedFS lists uploads unsorted): a pass that aborted some over several pages is
    followed by another, until one aborts nothing or fits in a page."""
    cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
    n = 0
    while True:
        aborted, paged = _abort_pass(bucket, prefix, cutoff, page)
        n += aborted
        if not aborted or not paged:
            return n


def _abort_pass(bucket: str, prefix: str, cutoff: datetime, page: int) -> tuple[int, bool]:
    """One walk of the listing: how many uploads it aborted, and whether it took pages."""
    query = {"uploads": "", "prefix": f"{prefix}/" if prefix else "", "max-uploads": str(page)}
    n, paged = 0, False
    while True:
        body = _request("GET", bucket, "", query)
        listed = _uploads(body)
        for key, upload_id, initiated in listed:
            if initiated < cutoff:
                _request("DELETE", bucket, key, {"uploadId": upload_id})
                n += 1
        after = _next_page(body, listed)
        if after is None or after == (query.get("key-marker"), query.get("upload-id-marker")):
            return n, paged  # the last page (or a server that would give the same one again)
        paged = True
        query.update({"key-marker": after[0], "upload-id-marker": after[1]})


def _next_page(xml: bytes, listed: list[tuple[str, str, datetime]]) -> tuple[str, str] | None:
    """The markers of the next page of ListMultipartUploads, None after the last. A server
    that leaves NextKeyMarker out (SeaweedFS) continues after the last upload listed."""
    fields = {el.tag.rpartition("}")[2]: el.text or "" for el in ET.fromstring(xml)}
    if fields.get("IsTruncated", "").lower() != "true" or not listed:
        return None
    return (fields.get("NextKeyMarker") or listed[-1][0],
            fields.get("NextUploadIdMarker") or listed[-1][1])


def abort_uploads_of(bucket: str, key: str) -> int:
    """Abort the unfinished multipart uploads of one object (its full key): a put cancelled
    half-way, its task cancelled or its process stopping. obstore aborts an upload that
    fails, not one whose task is cancelled."""
    n = 0
    for found, upload_id, _ in list_uploads(bucket, key):
        if found == key:
            _request("DELETE", bucket, key, {"uploadId": upload_id})
            n += 1
    return n


def list_uploads(bucket: str, prefix: str) -> list[tuple[str, str, datetime]]:
    """(key, upload id, initiated) of the uploads under `prefix` (tests look with it too)."""
    return _uploads(_request("GET", bucket, "", {"uploads": "", "prefix": prefix}))


def _uploads(xml: bytes) -> list[tuple[str, str, datetime]]:
    out = []
    for el in ET.fromstring(xml).iter():
        if not el.tag.endswith("Upload"):
            continue
        fields = {child.tag.rpartition("}")[2]: child.text or "" for child in el}
        when = datetime.fromisoformat(fields.get("Initiated", "").replace("Z", "+00:00"))
        out.append((fields.get("Key", ""), fields.get("UploadId", ""), when))
    return out


def _request(method: str, bucket: str, key: str, query: dict[str, str]) -> bytes:
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = (os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
                or f"https://s3.{region}.amazonaws.com").rstrip("/")
    host = urlsplit(endpoint).netloc
    path = "/" + quote(bucket) + ("/" + quote(key, safe="/~") if key else "")
    canonical_query = "&".join(f"{quote(k, safe='~')}={quote(v, safe='~')}"
                               for k, v in sorted(query.items()))
    now = datetime.now(UTC)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
    if token := os.environ.get("AWS_SESSION_TOKEN"):
        headers["x-amz-security-token"] = token
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, path, canonical_query,
                           "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)), signed,
                           EMPTY_SHA256])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    k = f"AWS4{secret}".encode()
    for part in (day, region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={os.environ.get('AWS_ACCESS_KEY_ID', '')}/{scope}, "
        f"SignedHeaders={signed}, Signature={signature}")
    url = f"{endpoint}{path}" + (f"?{canonical_query}" if canonical_query else "")
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return bytes(resp.read())
    except OSError as exc:  # URLError, HTTPError and timeouts are all OSErrors
        raise StoreUnavailable(f"{method} {path}: {exc}") from exc
