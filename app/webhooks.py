"""Webhooks (docs/api.md): which callback URLs a key may name, and how a delivery is signed.

A callback URL is a request the gateway makes on a caller's behalf, so it must never reach
anywhere the admin did not register for that key (an SSRF into the gateway's own network):
it is compared by its parts, not as a string, so `https://app.example.evil/`,
`https://app.example@evil/` or `https://app.example/hooks/../admin` do not pass for
`https://app.example/hooks/`. Nor does a path a receiver's server may read as another one:
`/hooks/..;/admin` (Tomcat and Spring drop `;` parameters, then resolve the `..`),
`/hooks/%2e%2e;/admin`, `/hooks/..%5cadmin` (IIS takes a backslash for `/`)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

_DEFAULT_PORTS = {"http": 80, "https": 443}


def new_secret() -> str:
    return "whsec_" + secrets.token_hex(32)


def _parts(url: str) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, path) of an http(s) URL fit to be called; None if it is not
    (no host, credentials, a bad port, dot segments, control characters)."""
    if any(c.isspace() or ord(c) < 0x20 or c == "\\" for c in url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or "@" in parts.netloc:
        return None
    path = parts.path or "/"
    if not _plain_path(path):
        return None
    return scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[scheme], path


def _plain_path(path: str) -> bool:
    """No segment a server could resolve elsewhere: no `;` parameters, no encoded slash or
    backslash, no control character, no dot segment, however often it is percent-decoded."""
    decoded = path
    for _ in range(4):  # %252e%252e is `..` to a server that decodes twice
        if ";" in decoded or any(ord(c) < 0x20 or c == "\\" for c in decoded):
            return False
        if any(seg in (".", "..") for seg in decoded.split("/")):
            return False
        once = unquote(decoded)
        if once == decoded:
            return True
        if once.count("/") != decoded.count("/"):  # %2f: a `/` the prefix check cannot see
            return False
        decoded = once
    return False  # still decoding after four rounds: nothing a real receiver path needs


def registrable(url: str) -> str | None:
    """Why `url` cannot be a key's registered callback prefix, or None if it can."""
    parts = _parts(url)
    if parts is None:
        return "must be an http(s) URL with a host, without user:password@ or dot segments"
    if "?" in url or "#" in url:
        return "must not carry a query or a fragment"
    return None


def allowed(url: str, prefixes: Iterable[str]) -> bool:
    """`url` lies under one of `prefixes`: same scheme, host and port, and a path that
    starts with the prefix's (at a segment boundary when the prefix has no trailing `/`)."""
    parts = _parts(url)
    if parts is None:
        return False
    scheme, host, port, path = parts
    for prefix in prefixes:
        reg = _parts(prefix)
        if reg is None or reg[:3] != (scheme, host, port):
            continue
        base = reg[3]
        if path == base or path.startswith(base if base.endswith("/") else base + "/"):
            return True
    return False


def signature(secret: str, timestamp: int, delivery: str, body: bytes) -> str:
    """The `X-Queue-Signature` header: `t=<unix s>,v1=<hex>,v0=<hex>`.

    v1 is HMAC-SHA256(secret, "<t>.<delivery id>.<body>"): a delivery captured and replayed
    under another `X-Queue-Delivery` (to slip past a receiver's de-duplication) no longer
    verifies. v0, the old HMAC(secret, "<t>.<body>"), stays for one release so receivers that
    check it keep working while they move to v1."""
    t = str(timestamp).encode()
    v1 = hmac.new(secret.encode(), b"%s.%s.%s" % (t, delivery.encode(), body), hashlib.sha256)
    v0 = hmac.new(secret.encode(), b"%s.%s" % (t, body), hashlib.sha256)
    return f"t={timestamp},v1={v1.hexdigest()},v0={v0.hexdigest()}"
