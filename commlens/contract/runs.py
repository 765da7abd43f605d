"""Runs and their ingested files (sources): what a client creates, changes and lists."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from .common import MAX_WORLD, StrictModel

MAX_RUN_NAME = 128
RUN_NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._+@=-]{{0,{MAX_RUN_NAME - 1}}}$"
TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+@=/-]{0,63}$"


class RunCreate(StrictModel):
    name: str = Field(pattern=RUN_NAME_PATTERN, description="letters, digits and . _ + @ = -; at most 128")
    description: str | None = Field(default=None, max_length=10_000)
    tags: list[str] = Field(default_factory=list, max_length=50)
    config: dict[str, Any] | None = Field(
        default=None, description="a harness run.json (commlens.run/1) or a predictor input (PredictInput)"
    )
    strategy: str | None = Field(default=None, min_length=1, max_length=128)
    world_size: int | None = Field(default=None, ge=1, le=MAX_WORLD, strict=True)  # "2" and true refused


class RunUpdate(StrictModel):
    """Fields to change; absent fields stay, `null` clears description/config/strategy/world_size. A new `name`
    is for the run's owner or an admin; the old one stays an alias of the run."""

    name: str | None = Field(default=None, pattern=RUN_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=10_000)
    tags: list[str] | None = Field(default=None, max_length=50)
    config: dict[str, Any] | None = None
    strategy: str | None = Field(default=None, min_length=1, max_length=128)
    world_size: int | None = Field(default=None, ge=1, le=MAX_WORLD, strict=True)  # "2" and true refused


class SourceCounts(BaseModel):
    total: int
    ok: int
    failed: int
    by_kind: dict[str, int]


class RunSummary(BaseModel):
    name: str
    description: str | None
    tags: list[str]
    strategy: str | None
    world_size: int | None
    config_kind: Literal["run_config", "predict_input", "model_description", "other"] | None
    sources: SourceCounts
    events: int
    jobs_active: int
    created_at: datetime
    updated_at: datetime
    owner: str | None = Field(
        default=None,
        description="the user who created the run; null: created by the CLI or a tokenless caller, before owners "
        "were recorded, or its user was deleted (admins rename such runs)",
    )


class RunDetail(RunSummary):
    config: dict[str, Any] | None
    ranks: int  # distinct known ranks with events
    n_processes: int = Field(
        default=0,
        description="processes with calls but no global rank (their files name none: an NCCL log's host:pid, a "
        "trace without distributedInfo); views keyed by rank count them beside `ranks`",
    )
    ops: dict[str, int]  # calls per op
    aliases: list[str] = Field(
        default_factory=list, description="former names, oldest first: API paths holding one reach this run"
    )


class SourceOut(BaseModel):
    source_id: int
    path: str
    kind: str
    status: str
    error: str | None
    rank: int | None
    world_size: int | None
    n_events: int
    size_bytes: int
    sha256: str
    skipped: dict[str, int] | None
    warnings: list[str] | None
    ingested_at: datetime
