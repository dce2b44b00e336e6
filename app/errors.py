"""The gateway's errors: `ApiError` (app/routes/errors.py answers it as `{"error": {"code": ...,
"message": ...}}` with its status) and the words a validation error says.

Kept free of the web framework and the stores' clients: the models, the endpoint rules and the
command line import it, and `qgw mock-upstream` or an admin command should not pay for FastAPI
at every start."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

if TYPE_CHECKING:
    from fastapi.exceptions import RequestValidationError


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers, self.extra = headers, extra


#: What a pattern-checked string must look like, in words: a regular expression is no answer
#: to a person (`expects` registers one where the pattern is defined).
EXPECTED: dict[str, str] = {}
_LOCATIONS = ("body", "query", "path", "header", "cookie")


def expects(pattern: str, what: str) -> str:
    """The pattern, registered with the words a validation error says instead of it."""
    EXPECTED[pattern] = what
    return pattern


def _message(err: Any) -> str:
    if err["type"] == "string_pattern_mismatch":
        pattern = str(err.get("ctx", {}).get("pattern"))
        what = EXPECTED.get(pattern, "a value of the documented form")
        return f"expected {what}"
    return str(err["msg"])


def describe(exc: ValidationError | RequestValidationError) -> str:
    """One readable line per problem, naming the field: `priority: Input should be greater
    than or equal to 0`, `target_url: expected an http:// or https:// URL ...`.  FastAPI puts
    where the value came from first (body, query ...): that part goes, a field named `body`
    stays; a problem with the whole body says so."""
    parts = []
    for err in exc.errors():
        loc = list(err["loc"])
        # A RequestValidationError (FastAPI's, not a pydantic ValidationError) names where
        # the value came from first.
        if not isinstance(exc, ValidationError) and loc and loc[0] in _LOCATIONS:
            where = loc.pop(0)
            if not loc:
                loc = [f"the {where}" if where == "body" else where]
        if "upstream_headers" in loc:  # the next part is a header name: it may hold a value
            loc = loc[:loc.index("upstream_headers") + 1]
        name = ".".join(str(p) for p in loc) or "the body"
        parts.append(f"{name}: {_message(err)}")
    return "; ".join(parts[:5])
