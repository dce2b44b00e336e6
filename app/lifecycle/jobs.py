"""The lifecycle jobs a dispatcher process runs beside its dispatcher: the outbox writer, the
pending-expiry sweep, the janitor, the result store's sweep and the dashboard's history
sampler, each its own loop, so one store being down stalls only the jobs that need it.
Stopping flushes the outbox once more (if SQL answers in time)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine

from app.core.keys import Keys
from app.core.loop import STORE_ERRORS, every
from app.core.registry import EndpointRegistry, cancel_all
from app.core.scripts import Scripts
from app.lifecycle import Ttls
from app.lifecycle.expiry import ExpirySweep
from app.lifecycle.history import TICK_S, HistorySampler
from app.lifecycle.janitor import Janitor
from app.lifecycle.orphans import OrphanSweep
from app.lifecycle.results import OutboxWriter, ResultStore
from app.queue.objects import ObjectStore, StoreUnavailable
from app.settings import Settings

log = logging.getLogger(__name__)
FINAL_FLUSH_S = 5.0


@dataclass
class LifecycleJobs:
    settings: Settings
    writer: OutboxWriter
    sweep: ExpirySweep
    janitor: Janitor
    history: HistorySampler
    orphans: OrphanSweep | None = None
    _loops: list[asyncio.Task[Any]] = field(default_factory=list)

    @classmethod
    def build(cls, settings: Settings, redis: Redis, keys: Keys, scripts: Scripts,
              registry: EndpointRegistry, engine: AsyncEngine,
              objects: ObjectStore | None = None) -> LifecycleJobs:
        return cls(
            settings,
            OutboxWriter(redis, keys, registry, ResultStore(engine), settings.outbox_batch,
                         settings.outbox_batch_bytes, Ttls.of(settings).done_ms,
                         objects=objects),
            ExpirySweep(redis, scripts, keys, registry, Ttls.of(settings)),
            Janitor(engine, settings.db_retention_s, settings.janitor_batch, redis, keys,
                    objects),
            HistorySampler(redis, keys, registry),
            OrphanSweep(objects, redis, keys, engine, settings.result_sweep_grace_s,
                        settings.result_sweep_interval_s)
            if objects is not None else None,
        )

    def start(self) -> None:
        s = self.settings
        for name, interval_s, step in (
            ("outbox writer", s.outbox_interval_ms / 1000, self.writer.flush),
            ("pending expiry", s.expiry_interval_ms / 1000, self.sweep.sweep),
            ("janitor", s.janitor_interval_s, self.janitor.run_once),
            ("history", TICK_S, self.history.tick),
            *([("result store sweep", s.result_sweep_interval_s, self.orphans.run_once)]
              if self.orphans is not None else []),
        ):
            self._loops.append(asyncio.create_task(
                every(name, interval_s, step, (*STORE_ERRORS, StoreUnavailable)), name=name))

    async def stop(self) -> None:
        await cancel_all(self._loops)
        try:  # what the dispatcher finished last goes to SQL now rather than at the next start
            await asyncio.wait_for(self.writer.flush(), FINAL_FLUSH_S)
        except STORE_ERRORS as exc:  # TimeoutError (the flush took too long) is one
            log.warning("outbox not flushed on stop (%s); the next writer will", exc)
