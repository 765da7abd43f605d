"""Request and response models of the API (analysis results use commlens.backend.models as they are)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from commlens.backend.compare import Comparison
from commlens.backend.models import GroupAttribution, Scheme

T = TypeVar("T")

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+@=-]{0,127}$"
MAX_RANK = 2**31 - 1  # ranks are INTEGER in the store
INLINE_REPLIES = 50  # replies shown inside a review item; GET /review/{id}/replies pages through all
TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+@=/-]{0,63}$"
Op = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter",
             "send", "recv", "barrier"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Page(BaseModel, Generic[T]):
    """A page of a list endpoint (limit/offset pagination; `next_offset` is null on the last page)."""

    items: list[T]
    total: int
    limit: int
    offset: int
    next_offset: int | None


# ------------------------------------------------------------------------------------ health


class AuthInfo(BaseModel):
    loopback_bind: bool
    insecure: bool
    users: int


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    schema_version: int
    runs: int
    jobs_queued: int
    jobs_running: int
    auth: AuthInfo


class Me(BaseModel):
    name: str
    is_admin: bool
    can_write: bool
    via: Literal["token", "loopback", "anonymous"]


# -------------------------------------------------------------------------------------- runs


class RunCreate(_Strict):
    name: str = Field(pattern=RUN_NAME_PATTERN, description="letters, digits and . _ + @ = -; at most 128")
    description: str | None = Field(None, max_length=10_000)
    tags: list[str] = Field(default_factory=list, max_length=50)
    config: dict[str, Any] | None = Field(
        None, description="a harness run.json (commlens.run/1) or a predictor input (PredictInput)")
    strategy: str | None = Field(None, max_length=128)
    world_size: int | None = Field(None, ge=1, le=10_000_000)


class RunUpdate(_Strict):
    """Fields to change; absent fields stay, `null` clears description/config/strategy/world_size."""

    name: str | None = Field(None, pattern=RUN_NAME_PATTERN)
    description: str | None = Field(None, max_length=10_000)
    tags: list[str] | None = Field(None, max_length=50)
    config: dict[str, Any] | None = None
    strategy: str | None = Field(None, max_length=128)
    world_size: int | None = Field(None, ge=1, le=10_000_000)


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
    config_kind: Literal["run_config", "predict_input", "other"] | None
    sources: SourceCounts
    events: int
    jobs_active: int
    created_at: datetime
    updated_at: datetime


class RunDetail(RunSummary):
    config: dict[str, Any] | None
    ranks: int  # distinct known ranks with events
    ops: dict[str, int]  # calls per op


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


# -------------------------------------------------------------------------------------- jobs


class FileResult(BaseModel):
    upload: str  # the uploaded file this result belongs to
    path: str  # the ingested file ("upload.tar.gz!member" for archive members)
    status: Literal["ok", "failed", "duplicate"]
    kind: str | None = None
    rank: int | None = None
    events: int = 0
    size: int = 0
    error: str | None = None
    skipped: dict[str, int] = {}
    warnings: list[str] = []


class JobOut(BaseModel):
    job_id: str
    run: str | None
    state: Literal["queued", "running", "done", "failed"]
    files_total: int  # uploaded files (an archive is one)
    files_done: int
    bytes_total: int
    bytes_done: int
    current: str | None = None  # the file being ingested
    results: list[FileResult]
    error: str | None
    created_at: datetime
    updated_at: datetime


# ------------------------------------------------------------------------------------ groups


class GroupsPage(Page[GroupAttribution]):
    """A page of the run's process groups with their scheme, and the run's calls per scheme."""

    run: str
    unattributed_events: int  # calls with no group: no scheme can be given to them
    events_by_scheme: dict[str, int]


class GroupOverride(_Strict):
    scheme: Scheme | None = Field(description="the scheme to pin; null drops the override and attributes again")
    reason: str | None = Field(None, max_length=2000, description="what you know that the traces do not say")


# ------------------------------------------------------------------------------------ review


class Anchor(_Strict):
    """The view a review item is attached to; every field is optional."""

    view: str | None = Field(None, max_length=64, pattern=r"^[a-z0-9_-]+$")
    scheme: Scheme | None = None
    op: Op | None = None
    bin: str | None = Field(None, max_length=16, pattern=r"^(zero|unknown|2\^\d{1,2})$")
    rank: int | None = Field(None, ge=0, le=MAX_RANK)
    free: str | None = Field(None, max_length=500, description="anything else that locates the item")


class ReviewCreate(_Strict):
    body: str = Field(min_length=1, max_length=100_000, description="Markdown; raw HTML is shown as text")
    anchor: Anchor | None = None
    parent_id: int | None = Field(None, description="reply to this item")


class ReviewUpdate(_Strict):
    body: str | None = Field(None, min_length=1, max_length=100_000)
    status: Literal["open", "resolved"] | None = None
    anchor: Anchor | None = None


class ReviewItem(BaseModel):
    item_id: int
    run: str
    parent_id: int | None
    author: str
    body: str
    body_html: str
    status: Literal["open", "resolved"]
    anchor: Anchor | None
    finding: str | None
    created_at: datetime
    updated_at: datetime
    replies: list["ReviewItem"] = Field(default_factory=list, description=f"the first replies, oldest first (at most {INLINE_REPLIES}); "
                                        "GET /api/review/{item_id}/replies pages through all of them")
    replies_total: int = 0


# ------------------------------------------------------------------------------------- users


class UserCreate(_Strict):
    name: str = Field(min_length=1, max_length=64)
    admin: bool = False


class UserOut(BaseModel):
    name: str
    is_admin: bool
    created_at: datetime


class UserToken(BaseModel):
    name: str
    is_admin: bool
    token: str = Field(description="shown once; only its sha256 is stored")


# ---------------------------------------------------------------------------------- topology


class TopologyRows(BaseModel):
    table: Literal["comms", "topology", "tuning"]
    columns: list[str]
    rows: list[list[Any]]
    total: int
    limit: int
    offset: int
    next_offset: int | None


# ---------------------------------------------------------------------------------- comparison


class RunComparison(BaseModel):
    run: str
    strategy: str | None
    world_size: int | None
    comparison: Comparison


class RunsComparison(BaseModel):
    runs: list[RunComparison]
