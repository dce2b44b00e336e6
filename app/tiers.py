"""Tiers of API keys and their weights (`PUT /admin/v1/tiers/{tier}`, `qgw tiers set`): on an
endpoint with `fairness: "weighted"`, a user whose key's tier weighs w takes w tasks a round
(lua/includes/fairness.lua). SQL holds the table; every process reads it from its mirror."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from app.core.registry import Mirror
from app.db import SQL_JOB_TIMEOUT_S, TierRow, bounded, utcnow
from app.errors import ApiError
from app.store import _Store

MAX_WEIGHT = 100  # fairness.lua's units of a turn (128) keep 1/100 of a turn apart
MAX_TIER = 32


class TierSettings(BaseModel):
    """The body of PUT /admin/v1/tiers/{tier}."""

    model_config = ConfigDict(extra="forbid", strict=True)

    weight: int = Field(ge=1, le=MAX_WEIGHT, description="tasks a round its users take on a "
                                                         "weighted endpoint (default 1)")


class TierView(TierSettings):
    tier: str


@dataclass(frozen=True, slots=True)
class Tier:
    tier: str
    weight: int


def weight_of(mirror: Mirror[Tier] | None, tier: str) -> int:
    """A tier's weight as this process knows it; 1 when it has none."""
    found = mirror.items.get(tier) if mirror is not None else None
    return found.weight if found is not None else 1


class TierStore(_Store):
    mirror: Mirror[Tier]

    async def load_all(self) -> dict[str, str]:
        return await bounded(self._load_all(), SQL_JOB_TIMEOUT_S)

    async def _load_all(self) -> dict[str, str]:
        async with self.sessions() as s:
            rows = (await s.scalars(select(TierRow))).all()
        return {r.tier: json.dumps(_view(r)) for r in rows}

    async def list(self) -> list[TierView]:
        async with self.sessions() as s:
            rows = (await bounded(s.scalars(select(TierRow).order_by(TierRow.tier)))).all()
        return [TierView(**_view(r)) for r in rows]

    async def set(self, tier: str, weight: int) -> TierView:
        if not 1 <= len(tier) <= MAX_TIER:  # as a key's tier (app/models.py ApiKeyCreate)
            raise ApiError(422, "invalid_request", f"a tier is 1 to {MAX_TIER} characters")
        view = await self._write(self._upsert(tier, weight))
        await self.mirror.put(tier, view)
        return TierView(**view)

    async def _upsert(self, tier: str, weight: int) -> dict[str, Any]:
        async with self.sessions.begin() as s:
            row = await s.get(TierRow, tier)
            if row is None:
                row = TierRow(tier=tier, weight=weight, updated_at=utcnow())
                s.add(row)
            row.weight = weight
            return _view(row)


def _view(row: TierRow) -> dict[str, Any]:
    return {"tier": row.tier, "weight": row.weight}
