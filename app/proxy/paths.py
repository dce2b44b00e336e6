"""Where a proxied request goes: `{path}` under the endpoint's `target_url`, never outside it."""

from __future__ import annotations

import re

#: Bytes a path segment may hold as sent (RFC 3986 pchar, percent-escapes checked apart).
_SEGMENT = re.compile(r"^[A-Za-z0-9\-._~!$&'()*+,=:@%]*$")
#: Escapes that would decode into a separator, a dot, a backslash or a control character: an
#: upstream (or a server in front of it) that decodes them sees another path than we checked.
_RISKY_ESCAPE = re.compile(r"%(2[eEfF]|5[cC]|3[bB]|[01][0-9a-fA-F]|7[fF]|25)")


def upstream_url(target_url: str, raw_rest: str, query: str) -> str | None:
    """`target_url` joined with the raw (still percent-encoded) rest of the request's path and
    its query; None when the rest could leave the target's prefix (`..`, encoded slashes,
    `;` parameters, backslashes), which the route answers 404 without calling anything."""
    segments = raw_rest.split("/") if raw_rest else []
    for seg in segments:
        if seg in (".", "..") or not _SEGMENT.match(seg) or _RISKY_ESCAPE.search(seg):
            return None
    if "%" in raw_rest and re.search(r"%(?![0-9A-Fa-f]{2})", raw_rest):
        return None  # a lone % is not an escape: servers disagree on what it means
    url = target_url.rstrip("/")
    if segments:
        url += "/" + "/".join(segments)
    if query:
        url += "?" + query
    return url
