"""Task lifecycle (seed 002): how long Redis keeps a task in each stage.

Pending tasks live `pending` (then they expire and never run); finished ones `done`; a finished
task its owner has read keeps only `read` (it has been delivered). Scripts take milliseconds.

SQL keeps finished tasks for QGW_DB_RETENTION_S: `results` (outbox writer, status fallback),
`expiry` (pending deadline sweep), `janitor` (purge), `jobs` (the loops a dispatcher runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.queue.objects import SIGNED_MARGIN_S, SIGNED_S
from app.settings import Settings


@dataclass(frozen=True, slots=True)
class Ttls:
    pending_ms: int
    done_ms: int
    read_ms: int
    #: A read result in the result store (`external`) stays longer: it is fetched in pieces
    #: after the read (a resumed Range download, a presigned URL valid SIGNED_S), which a
    #: row and object gone at the read TTL would cut short with a 404.
    read_external_ms: int

    @classmethod
    def of(cls, settings: Settings) -> Ttls:
        read_ms = settings.read_ttl_s * 1000
        return cls(settings.pending_ttl_s * 1000, settings.done_ttl_s * 1000, read_ms,
                   max(read_ms, (SIGNED_S + SIGNED_MARGIN_S) * 1000))
