"""Online permits: HMAC-SHA256 over task id and expiry, with the secret replicas share."""

from __future__ import annotations

import base64
import hashlib
import hmac

MAX_EXPIRY_DIGITS = 15  # ms since 1970: 13 digits until the year 2286


def sign(secret: bytes, task_id: str, expires_ms: int) -> str:
    mac = hmac.new(secret, f"{task_id}\n{expires_ms}".encode(), hashlib.sha256).digest()
    return f"{expires_ms}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def verify(secret: bytes, task_id: str, token: str) -> bool:
    """Genuine: the signature is compared in constant time. Whether it has expired is for the
    Redis clock to say (lua/permit-1.lua), not this host's."""
    expires, _, _ = token.partition(".")
    # int() refuses `²`, and more than 4300 digits (a 500); a real expiry has 13.
    if not (expires.isascii() and expires.isdigit() and len(expires) <= MAX_EXPIRY_DIGITS):
        return False
    return hmac.compare_digest(sign(secret, task_id, int(expires)), token)
