"""Submit, status, cancel and complete: each one Redis round trip (one script)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from redis.asyncio import Redis

from app import permits
from app.endpoints import EndpointConfig
from app.errors import ApiError
from app.lifecycle import Ttls
from app.models import Permit, SubmitRequest, SubmitResponse, TaskStatus, TaskType, TaskView
from app.queue.ids import new_task_id
from app.queue.keys import Keys, endpoint_of
from app.queue.scripts import Scripts
from app.settings import Settings
from app.store import ApiKey
from app.timefmt import rfc3339

IDEMPOTENCY_TTL_MS = 24 * 3600 * 1000


@dataclass
class TaskQueue:
    redis: Redis
    keys: Keys
    scripts: Scripts
    settings: Settings

    @cached_property
    def ttls(self) -> Ttls:
        return Ttls.of(self.settings)

    async def submit(
        self, key: ApiKey, endpoint: EndpointConfig, req: SubmitRequest, idem_key: str | None
    ) -> SubmitResponse | str:
        """Enqueue; returns the response, or the id of the task an Idempotency-Key names."""
        e, k, user_id = endpoint.id, self.keys, key.user_id
        task_id = new_task_id(e)
        day = int(time.time() // 86400)
        fields: list[str | int] = [
            "user_id", user_id, "type", req.task_type, "priority", req.priority,
            "method", req.http_method, "url", req.target_url, "body", req.body,
            "headers", json.dumps(req.headers), "query", json.dumps(req.query_params),
            "client_ts", req.timestamp or "",
        ]
        idem = k.idempotency(user_id, idem_key) if idem_key else k.idempotency(user_id, "-")
        res = await self.scripts.submit(
            keys=[k.queue(e), k.task(task_id), k.seq(e), k.wake, idem, k.quota(user_id, day)],
            args=[task_id, e, req.priority, endpoint.max_queue_len,
                  self.ttls.pending_ms, "1" if idem_key else "0",
                  IDEMPOTENCY_TTL_MS, key.daily_quota, (day + 1) * 86_400_000, *fields],
        )
        if res[0] == "dup":
            return str(res[1])
        if res[0] == "quota":
            retry = max(1, int(res[1]) // 1000 + 1)
            raise ApiError(429, "quota_exceeded",
                           f"the daily quota of {key.daily_quota} tasks is used up",
                           {"Retry-After": str(retry)})
        if res[0] == "full":
            raise ApiError(503, "queue_full", f"the queue of {e!r} is full",
                           {"Retry-After": "5"})
        return SubmitResponse(task_id=task_id, task_status=TaskStatus.PENDING,
                              created_at=rfc3339(res[3]), wait_num=int(res[2]))

    async def status(self, user_id: int, task_id: str, endpoint: EndpointConfig | None) -> TaskView:
        k, e = self.keys, endpoint_of(task_id)
        res = await self.scripts.status(
            keys=[k.task(task_id), k.queue(e), k.stats(e)],
            args=[task_id, user_id, self.ttls.read_ms],
        )
        if not res:
            raise ApiError(404, "task_not_found", f"no task {task_id!r}")
        rank, exec_ms = res[0], res[1]
        fields = dict(zip(res[2::2], res[3::2], strict=True))
        return self._view(task_id, fields, rank, exec_ms, endpoint)

    def _view(
        self, task_id: str, f: dict[str, str], rank: int | None, exec_ms: str | None,
        endpoint: EndpointConfig | None,
    ) -> TaskView:
        status = TaskStatus(f["status"])
        ttype = TaskType(f["type"])
        wait_num = int(rank) if rank is not None else 0
        permit = None
        if ttype is TaskType.ONLINE and status is TaskStatus.PROCESSING and f.get("deadline"):
            expires = int(f["deadline"])
            permit = Permit(token=permits.sign(self.settings.permit_key, task_id, expires),
                            expires_at=rfc3339(expires) or "")
        code = f.get("result_status_code")
        return TaskView(
            task_id=task_id, task_type=ttype, task_status=status,
            task_result=f.get("result"), wait_num=wait_num,
            wait_time=estimate_wait(endpoint, wait_num, exec_ms) if rank is not None else 0,
            created_at=rfc3339(f.get("created_at")), started_at=rfc3339(f.get("started_at")),
            ended_at=rfc3339(f.get("ended_at")),
            result_status_code=int(code) if code else None,
            attempts=int(f.get("attempts", 0)), permit=permit,
        )

    async def cancel(self, user_id: int, task_id: str) -> TaskStatus:
        k, e = self.keys, endpoint_of(task_id)
        res = await self.scripts.cancel(
            keys=[k.task(task_id), k.queue(e), k.active(e), k.wake],
            args=[task_id, user_id, self.ttls.done_ms, e],
        )
        if res[0] == "missing":
            raise ApiError(404, "task_not_found", f"no task {task_id!r}")
        if res[0] == "conflict":
            raise ApiError(409, "task_not_cancellable",
                           f"task {task_id!r} is {res[1]} and cannot be cancelled",
                           task_status=res[1])
        return TaskStatus.CANCELLED

    async def complete(self, user_id: int, task_id: str, result: str | None) -> TaskStatus:
        """An admitted online task is done: its slot frees before the permit runs out."""
        k, e = self.keys, endpoint_of(task_id)
        res = await self.scripts.complete(
            keys=[k.task(task_id), k.active(e), k.queue(e), k.wake],
            args=[task_id, user_id, result or "", self.ttls.done_ms, e],
        )
        if res[0] == "missing":
            raise ApiError(404, "task_not_found", f"no task {task_id!r}")
        if res[0] == "conflict":
            raise ApiError(409, "task_not_completable",
                           f"task {task_id!r} is {res[1]}; only an admitted online task can be "
                           "completed", task_status=res[1])
        return TaskStatus.COMPLETED


def estimate_wait(endpoint: EndpointConfig | None, ahead: int, exec_ms: Any) -> float:
    """Seconds until a task with `ahead` tasks before it starts: ahead / sustainable throughput.

    Throughput is min(rate / interval, concurrency / exec time), with the measured exec time
    once there is one (the seed's pending / QPS x exec time had the unit of seconds squared).
    """
    if endpoint is None or ahead == 0:
        return 0.0
    limits = []
    if endpoint.rate > 0:
        limits.append(endpoint.rate / (endpoint.interval_ms / 1000))
    if endpoint.max_concurrency > 0:
        exec_s = (float(exec_ms) if exec_ms else endpoint.avg_exec_ms) / 1000
        limits.append(endpoint.max_concurrency / max(exec_s, 0.001))
    if not limits:
        return 0.0
    return round(ahead / min(limits), 3)
