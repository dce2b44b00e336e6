"""Admin writes: endpoints and API keys in SQL first, then published to the Redis mirrors.

Every statement here is bounded (app/db.py `bounded`): a database that stops answering costs
an admin call a 503 within seconds, not a hang until TCP gives up. A write whose commit
outcome that leaves unknown, or whose publication fails (Redis down), is still made good:
the mirrors converge to SQL (app/core/registry.py, Mirror.reconcile)."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from app.core.loop import STORE_ERRORS
from app.core.registry import Mirror
from app.db import SQL_JOB_TIMEOUT_S, ApiKeyRow, EndpointRow, bounded, sessions, utcnow
from app.endpoints import EndpointConfig
from app.errors import ApiError, describe
from app.models import MAX_PRIORITY
from app.secrets import AS_IS, Keyring, NotSealable, Undecryptable
from app.webhooks import new_secret

log = logging.getLogger(__name__)
T = TypeVar("T")
ENDPOINT_FIELDS = tuple(EndpointConfig.model_fields)


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    user_id: int
    tier: str
    max_priority: int
    daily_quota: int
    callback_urls: tuple[str, ...] = ()
    webhook_secret: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "callback_urls", tuple(self.callback_urls))  # JSON: a list


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _endpoint(row: EndpointRow) -> EndpointConfig:
    fields = {f: getattr(row, f) for f in ENDPOINT_FIELDS}
    fields["upstream_headers"] = fields["upstream_headers"] or {}
    return EndpointConfig.model_validate(fields)


class _Store:
    def __init__(self, engine: AsyncEngine, mirror: Mirror[Any]) -> None:
        self.sessions, self.mirror = sessions(engine), mirror

    async def _write(self, work: Awaitable[T]) -> T:
        """`work` (an SQL write), bounded. Past the bound its commit may still land, unseen
        by the mirror: the mirror is then reconciled with SQL as soon as SQL answers."""
        try:
            return await bounded(work)
        except TimeoutError:
            self.mirror.mark_stale()
            raise


def _held(config: EndpointConfig) -> dict[str, Any]:
    """The endpoint as stored and mirrored: upstream_headers sealed, never masked."""
    return config.model_dump(context=AS_IS)


class EndpointStore(_Store):
    """Endpoints; `keyring` seals the upstream_headers an admin gives before they are
    written anywhere (a store for reads only needs none)."""

    mirror: Mirror[EndpointConfig]

    def __init__(self, engine: AsyncEngine, mirror: Mirror[Any],
                 keyring: Keyring | None = None) -> None:
        super().__init__(engine, mirror)
        self.keyring = keyring

    def _sealed(self, endpoint_id: str, given: dict[str, str],
                stored: dict[str, str]) -> dict[str, str]:
        if not given:
            return {}
        if self.keyring is None:
            raise RuntimeError("this store cannot seal upstream_headers")
        try:
            return self.keyring.seal_given(endpoint_id, given, stored)
        except NotSealable as exc:
            raise ApiError(422, "invalid_request", str(exc)) from None

    async def load_all(self) -> dict[str, str]:
        """Rows as the mirror stores them (id -> JSON)."""
        return await bounded(self._load_all(), SQL_JOB_TIMEOUT_S)

    async def _load_all(self) -> dict[str, str]:
        async with self.sessions() as s:
            rows = (await s.scalars(select(EndpointRow))).all()
        return {r.id: _endpoint(r).model_dump_json(context=AS_IS) for r in rows}

    async def _list(self) -> list[EndpointConfig]:
        async with self.sessions() as s:
            rows = (await s.scalars(select(EndpointRow).order_by(EndpointRow.id))).all()
        return [_endpoint(r) for r in rows]

    async def list(self) -> list[EndpointConfig]:
        return await bounded(self._list())

    async def get(self, endpoint_id: str) -> EndpointConfig:
        row = await bounded(self._row(endpoint_id))
        if row is None:
            raise ApiError(404, "endpoint_not_found", f"no endpoint {endpoint_id!r}")
        return _endpoint(row)

    async def _row(self, endpoint_id: str) -> EndpointRow | None:
        async with self.sessions() as s:
            row: EndpointRow | None = await s.get(EndpointRow, endpoint_id)
        return row

    async def create(self, config: EndpointConfig) -> EndpointConfig:
        """`config` as an admin gave it (plain upstream_headers); returns it as stored."""
        self._check_url_free(config)
        config = EndpointConfig.model_validate({
            **_held(config),
            "upstream_headers": self._sealed(config.id, config.upstream_headers, {})})
        await self._write(self._insert(config))
        await self.mirror.put(config.id, _held(config))
        return config

    async def _insert(self, config: EndpointConfig) -> None:
        exists = ApiError(409, "endpoint_exists", f"endpoint {config.id!r} exists")
        try:
            async with self.sessions.begin() as s:
                # Looked up first: a commit that fails on the key leaves its connection to be
                # reset by the garbage collector, which a short-lived CLI loop has closed.
                if await s.get(EndpointRow, config.id) is not None:
                    raise exists
                s.add(EndpointRow(**_held(config)))
        except IntegrityError:  # created by someone else meanwhile
            raise exists from None

    async def update(self, endpoint_id: str, changes: dict[str, Any]) -> EndpointConfig:
        """`changes` as an admin gave them (plain upstream_headers, `<set>` keeping one)."""
        return await self._write(self._update(endpoint_id, changes))

    async def _update(self, endpoint_id: str, changes: dict[str, Any]) -> EndpointConfig:
        async with self.sessions.begin() as s:
            row = await s.get(EndpointRow, endpoint_id, with_for_update=True)
            if row is None:
                raise ApiError(404, "endpoint_not_found", f"no endpoint {endpoint_id!r}")
            merged = {**_held(_endpoint(row)), **changes, "id": endpoint_id}
            if "upstream_headers" in changes:
                merged["upstream_headers"] = self._sealed(
                    endpoint_id, changes["upstream_headers"], row.upstream_headers or {})
            try:  # each change was checked alone; together they may still disagree
                config = EndpointConfig.model_validate(merged)
            except ValidationError as exc:
                raise ApiError(422, "invalid_request", describe(exc)) from None
            self._check_url_free(config)
            for field, value in _held(config).items():
                setattr(row, field, value)
            return await self._publish_locked(s, endpoint_id, config)

    async def _publish_locked(self, s: AsyncSession, endpoint_id: str,
                              config: EndpointConfig) -> EndpointConfig:
        """Publish the row to the mirror while its SQL lock is held, so the writes of one
        endpoint (an admin's PATCH, `qgw secrets rotate`) reach the mirror in the order they
        commit: the newest row wins, never a stale credential until the next reconcile. A
        mirror that cannot be written lets the SQL write commit (the reconcile brings the
        mirror level, as before); one written ahead of a commit that fails is reconciled."""
        await s.flush()  # the row is written (and locked) before anyone sees it
        failed: RedisError | OSError | None = None
        try:
            await self.mirror.put(endpoint_id, _held(config))
        except (RedisError, OSError) as exc:  # put() marked the mirror stale
            failed = exc
        try:
            await s.commit()
        except BaseException:
            self.mirror.mark_stale()
            raise
        if failed is not None:
            raise failed
        return config

    async def reseal(self) -> dict[str, int]:
        """Seal every endpoint's upstream_headers with the current key (`qgw secrets
        rotate`), row by row, and publish each endpoint to the mirror again."""
        assert self.keyring is not None
        async with self.sessions() as s:
            ids = list((await s.scalars(select(EndpointRow.id))).all())
        count = {"endpoints": len(ids), "resealed": 0}
        for endpoint_id in ids:  # each published under its row lock (_publish_locked)
            await self._write(self._reseal(endpoint_id, count))
        return count

    async def _reseal(self, endpoint_id: str, count: dict[str, int]) -> EndpointConfig | None:
        assert self.keyring is not None
        async with self.sessions.begin() as s:
            row = await s.get(EndpointRow, endpoint_id, with_for_update=True)
            if row is None:
                return None
            try:
                again = self.keyring.reseal(endpoint_id, row.upstream_headers or {})
            except Undecryptable as exc:
                raise ApiError(409, "secrets_key_missing", str(exc)) from None
            if again is not None:
                row.upstream_headers = again
                count["resealed"] += 1
            return await self._publish_locked(s, endpoint_id, _endpoint(row))

    async def delete(self, endpoint_id: str) -> None:
        await self._write(self._delete(endpoint_id))
        await self.mirror.put(endpoint_id, None)

    async def _delete(self, endpoint_id: str) -> None:
        async with self.sessions.begin() as s:
            row = await s.get(EndpointRow, endpoint_id)
            if row is None:
                raise ApiError(404, "endpoint_not_found", f"no endpoint {endpoint_id!r}")
            await s.delete(row)

    async def restore(self, endpoint_id: str) -> None:
        """Publish the endpoint again as SQL has it (after a delete that did not go through);
        if that fails too, the mirror's reconcile does it once the stores answer."""
        try:
            row = await bounded(self._row(endpoint_id))
            if row is not None:
                await self.mirror.put(endpoint_id, _held(_endpoint(row)))
        except STORE_ERRORS as exc:
            self.mirror.mark_stale()
            log.warning("endpoint %s: not put back yet (%s); the reconcile will", endpoint_id,
                        exc)

    def _check_url_free(self, config: EndpointConfig) -> None:
        """One URL, one endpoint: otherwise a submit could not tell which queue it joins."""
        for other in self.mirror.items.values():
            if other.id != config.id and other.key == config.key:
                raise ApiError(
                    409, "endpoint_url_taken", f"endpoint {other.id!r} already serves this URL"
                )


class KeyStore(_Store):
    mirror: Mirror[ApiKey]

    async def load_all(self) -> dict[str, str]:
        return await bounded(self._load_all(), SQL_JOB_TIMEOUT_S)

    async def _load_all(self) -> dict[str, str]:
        async with self.sessions() as s:
            rows = (await s.scalars(select(ApiKeyRow).where(ApiKeyRow.revoked_at.is_(None)))).all()
        return {r.key_hash: json.dumps(_mirrored(r)) for r in rows}

    async def create(
        self, user_id: int, tier: str, max_priority: int, daily_quota: int,
        callback_urls: list[str] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """A new key; the plain key is returned here once and stored only as a hash, its
        webhook secret returned here once (the dispatchers sign with it)."""
        if not 0 <= max_priority <= MAX_PRIORITY:
            raise ApiError(422, "invalid_request", f"max_priority must be 0..{MAX_PRIORITY}")
        plain = "qgw_" + secrets.token_urlsafe(32)
        row = ApiKeyRow(
            id=secrets.token_hex(8), key_hash=hash_key(plain), user_id=user_id, tier=tier,
            max_priority=max_priority, daily_quota=daily_quota, created_at=utcnow(),
            callback_urls=list(callback_urls or ()), webhook_secret=new_secret(),
        )
        await self._write(self._insert(row))
        view = _mirrored(row)
        await self.mirror.put(row.key_hash, view)
        return plain, view

    async def _insert(self, row: ApiKeyRow) -> None:
        async with self.sessions.begin() as s:
            s.add(row)

    async def _list(self) -> list[dict[str, Any]]:
        async with self.sessions() as s:
            rows = (await s.scalars(select(ApiKeyRow).order_by(ApiKeyRow.created_at))).all()
        return [
            {**_key_view(r), "created_at": r.created_at.isoformat() + "Z",
             "revoked": r.revoked_at is not None}
            for r in rows
        ]

    async def list(self) -> list[dict[str, Any]]:
        return await bounded(self._list())

    async def revoke(self, key_id: str) -> None:
        await self.mirror.put(await self._write(self._revoke(key_id)), None)

    async def _revoke(self, key_id: str) -> str:
        """Marks the key revoked; returns its hash (the mirror's id for it)."""
        async with self.sessions.begin() as s:
            row = await s.get(ApiKeyRow, key_id)
            if row is None:
                raise ApiError(404, "api_key_not_found", f"no API key {key_id!r}")
            row.revoked_at = row.revoked_at or utcnow()
            key_hash: str = row.key_hash
        return key_hash


def _key_view(row: ApiKeyRow) -> dict[str, Any]:
    """What the admin sees of a key (never the key nor its webhook secret)."""
    return {"id": row.id, "user_id": row.user_id, "tier": row.tier,
            "max_priority": row.max_priority, "daily_quota": row.daily_quota,
            "callback_urls": list(row.callback_urls or ())}


def _mirrored(row: ApiKeyRow) -> dict[str, Any]:
    """What the Redis mirror holds of a key: with the secret its webhooks are signed with."""
    return {**_key_view(row), "webhook_secret": row.webhook_secret or ""}
