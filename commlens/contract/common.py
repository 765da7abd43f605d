"""Shapes every topic shares: pagination and the strict base of request bodies."""

from __future__ import annotations

from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")

MAX_RANK = 2**31 - 1  # ranks are INTEGER in the store
MAX_WORLD = 10_000_000  # the most ranks a job may have (a run's world_size, a prediction's dp*tp*pp*cp*ep)


class StrictModel(BaseModel):
    """A request body: an unknown field is a client's typo, refused rather than ignored."""

    model_config = ConfigDict(extra="forbid")


class Page(BaseModel, Generic[T]):
    """A page of a list endpoint (limit/offset pagination; `next_offset` is null on the last page)."""

    items: list[T]
    total: int
    limit: int
    offset: int
    next_offset: int | None
