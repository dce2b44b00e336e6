"""Credentials an endpoint sends upstream (`upstream_headers`): sealed with AES-256-GCM wherever
they are kept (SQL, the Redis mirror), opened only by the process making the call, at call time,
and shown to nobody (`mask`).

A sealed value reads `qgw1.<key id>.<base64url(nonce | ciphertext | tag)>`: the key id names the
key that sealed it, so a rotated key (QGW_SECRETS_KEY_PREVIOUS) still opens it, and
`qgw secrets rotate` knows which values to seal again. The associated data binds a value to its
endpoint and header name: a sealed value copied to another endpoint or name does not open.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from app import logs

#: What every answer, listing, page and log line shows in place of a value.
MASK = "<set>"
#: `model_dump(context=AS_IS)` gives upstream_headers as held (sealed in the stores, plain in
#: an admin request being handled); any other dump masks them.
AS_IS = {"upstream_headers": "as_is"}
_FORMAT = "qgw1"
KEY_BYTES = 32


class Undecryptable(Exception):
    """A sealed value this process cannot open (its key is not held, or the value was altered).
    The message names the endpoint, header and key id, never a value."""


#: The longest value, in UTF-8 bytes (sealed, it takes about 4/3 of that and 30 characters).
MAX_VALUE_BYTES = 4096


class NotSealable(ValueError):
    """A value the store cannot take: `<set>` for a header the endpoint does not have, or one
    too long."""


def mask(headers: Mapping[str, str]) -> dict[str, str]:
    """The one view of upstream_headers anybody gets: the names, each value `<set>`."""
    return dict.fromkeys(headers, MASK)


def parse_key(text: str) -> bytes:
    """A 32-byte key written as 64 hex digits or in base64 (standard or URL-safe, padding
    optional)."""
    text = text.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    try:
        raw = base64.urlsafe_b64decode(
            text.replace("+", "-").replace("/", "_") + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != KEY_BYTES:
        raise ValueError("must be 32 bytes, as 64 hex digits or base64 (43 or 44 characters)")
    return raw


def new_key() -> str:
    """A fresh key, as written into the data dir (URL-safe base64, no padding)."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).rstrip(b"=").decode()


def key_id(key: bytes) -> str:
    """A short public name of a key (a hash of it, not the key)."""
    return hashlib.sha256(b"qgw secrets key id\0" + key).hexdigest()[:12]


def _aad(endpoint_id: str, name: str) -> bytes:
    return f"qgw upstream_headers\0{endpoint_id}\0{name.lower()}".encode()


@dataclass(frozen=True, eq=False)
class Keyring:
    """The current key (seals) and the previous one (still opens) after a rotation."""

    current: bytes
    previous: bytes | None = None
    _ciphers: dict[str, AESGCM] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        keys = [self.current, *([self.previous] if self.previous else [])]
        object.__setattr__(self, "_ciphers", {key_id(k): AESGCM(k) for k in reversed(keys)})

    @property
    def current_id(self) -> str:
        return key_id(self.current)

    def seal(self, endpoint_id: str, name: str, value: str) -> str:
        nonce = os.urandom(12)
        sealed = self._ciphers[self.current_id].encrypt(nonce, value.encode(),
                                                        _aad(endpoint_id, name))
        blob = base64.urlsafe_b64encode(nonce + sealed).rstrip(b"=").decode()
        return f"{_FORMAT}.{self.current_id}.{blob}"

    def open(self, endpoint_id: str, name: str, token: str) -> str:
        kid = sealed_by(token)
        cipher = self._ciphers.get(kid or "")
        where = f"upstream_headers of endpoint {endpoint_id!r}: {name}"
        if cipher is None:
            raise Undecryptable(f"{where} was sealed with key id {kid or '?'}, which this "
                                "process does not hold (QGW_SECRETS_KEY, "
                                "QGW_SECRETS_KEY_PREVIOUS)")
        blob = token.rsplit(".", 1)[1]
        try:
            raw = base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4))
            value = cipher.decrypt(raw[:12], raw[12:], _aad(endpoint_id, name)).decode()
        except (InvalidTag, ValueError, binascii.Error):
            raise Undecryptable(f"{where} does not open with key id {kid}: altered, or sealed "
                                "for another endpoint") from None
        # A value has no shape the log patterns know (Ocp-Apim-Subscription-Key, x-goog-...):
        # once this process holds it in plain text, no log line it writes may show it (an
        # upstream's error body may echo it back).
        logs.redact(*forms(value))
        return value

    def seal_given(self, endpoint_id: str, given: Mapping[str, str],
                   stored: Mapping[str, str]) -> dict[str, str]:
        """`given` (plain values from an admin) sealed; `<set>` keeps the stored value of that
        name, so what an answer shows can be sent back as it is."""
        held = {name.lower(): token for name, token in stored.items()}
        out = {}
        for name, value in given.items():
            if value == MASK:
                if name.lower() not in held:
                    raise NotSealable(f"upstream_headers: {name} is {MASK!r} but the endpoint has "
                                    "no value for it; give the value")
                out[name] = held[name.lower()]
            elif len(value.encode()) > MAX_VALUE_BYTES:
                raise NotSealable(f"upstream_headers: the value of {name} is over "
                                  f"{MAX_VALUE_BYTES} bytes")
            else:
                out[name] = self.seal(endpoint_id, name, value)
        return out

    def reseal(self, endpoint_id: str, stored: Mapping[str, str]) -> dict[str, str] | None:
        """`stored` with every value sealed by an older key sealed again with the current
        one; None when all already are."""
        if all(sealed_by(t) == self.current_id for t in stored.values()):
            return None
        return {name: token if sealed_by(token) == self.current_id
                else self.seal(endpoint_id, name, self.open(endpoint_id, name, token))
                for name, token in stored.items()}


def sealed_by(token: str) -> str | None:
    """The key id of a sealed value (None if it is not one)."""
    parts = token.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == _FORMAT else None


@dataclass(frozen=True, slots=True)
class Credentials:
    """An endpoint's upstream_headers as its calls carry them: sealed until the call."""

    endpoint_id: str
    sealed: tuple[tuple[str, str], ...]


_keyring: Keyring | None = None


def install(keyring: Keyring) -> None:
    """The key this process opens credentials with (set when its runtime starts)."""
    global _keyring
    _keyring = keyring


def outgoing(headers: list[tuple[str, str]], credentials: Credentials | None
             ) -> list[tuple[str, str]]:
    """A call's headers with the endpoint's credentials added; a caller's header of the same
    name is dropped (credentials are never taken from a caller)."""
    if credentials is None:
        return headers
    if _keyring is None:
        raise Undecryptable(f"upstream_headers of endpoint {credentials.endpoint_id!r}: this "
                            "process holds no secrets key")
    opened = _opened(_keyring, credentials)
    names = {name.lower() for name, _ in opened}
    return [h for h in headers if h[0].lower() not in names] + list(opened)


@lru_cache(maxsize=4096)
def _opened(keyring: Keyring, credentials: Credentials) -> tuple[tuple[str, str], ...]:
    # Each write of an endpoint seals with fresh nonces: a changed value is a new cache entry,
    # an unchanged endpoint costs a dictionary lookup a call, not an AES-GCM open.
    return tuple((name, keyring.open(credentials.endpoint_id, name, token))
                 for name, token in credentials.sealed)


#: The shortest form hidden: shorter ones would hide ordinary words (logs.redact's bound).
MIN_HIDDEN = 8
_HIDDEN = logs.REDACTED.encode()


def forms(value: str) -> tuple[str, ...]:
    """What of a credential's value an upstream may echo back: the value, and the token after
    its scheme (`Bearer sk-...` comes back as `sk-...`)."""
    words = value.split()
    token = words[-1] if len(words) > 1 else value
    return (value, token) if token != value and len(token) >= MIN_HIDDEN else (value,)


def echoes(credentials: Credentials | None) -> tuple[bytes, ...]:
    """The byte strings an upstream's answer must not carry back to a caller: the forms of the
    endpoint's credentials, longest first (a value goes whole before its token could)."""
    if credentials is None or _keyring is None:
        return ()
    try:
        return _echoes(_keyring, credentials)
    except Undecryptable:  # never sent, so never echoed
        return ()


@lru_cache(maxsize=4096)
def _echoes(keyring: Keyring, credentials: Credentials) -> tuple[bytes, ...]:
    found = {f.encode() for _, value in _opened(keyring, credentials) for f in forms(value)
             if len(f) >= MIN_HIDDEN}
    return tuple(sorted(found, key=len, reverse=True))


def hide(data: bytes, echoed: tuple[bytes, ...]) -> bytes:
    """`data` with every echo of a credential replaced by `[redacted]`."""
    for value in echoed:
        if value in data:
            data = data.replace(value, _HIDDEN)
    return data


class Hider:
    """`hide` over a stream read a piece at a time: the last bytes of each piece, which could
    begin a value the next piece ends, are held back until that piece comes."""

    __slots__ = ("_echoed", "_held", "_keep")

    def __init__(self, echoed: tuple[bytes, ...]) -> None:
        self._echoed, self._held = echoed, b""
        self._keep = max(map(len, echoed)) - 1

    def feed(self, piece: bytes) -> bytes:
        data = hide(self._held + piece, self._echoed)
        cut = max(0, len(data) - self._keep)
        self._held = data[cut:]
        return data[:cut]

    def end(self) -> bytes:
        held, self._held = self._held, b""
        return held
