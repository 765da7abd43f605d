"""Review items: comments and promoted findings attached to a run and to the view they discuss."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from commlens.vocab import Op, Scheme

from .analysis import bin_spec
from .common import MAX_RANK, StrictModel

MAX_BODY = 100_000  # characters of a review item's Markdown
INLINE_REPLIES = 50  # replies shown inside a review item; GET /review/{id}/replies pages through all


class Anchor(StrictModel):
    """The view a review item is attached to; every field is optional, and an anchor with none set ({}) is no
    anchor: it is stored and shown as null."""

    view: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9_-]+$")
    scheme: Scheme | None = None
    op: Op | None = None
    bin: str | None = Field(default=None, max_length=16, description="'zero', 'unknown' or '2^k', 0 <= k <= 62")
    rank: int | None = Field(default=None, ge=0, le=MAX_RANK)
    free: str | None = Field(default=None, max_length=500, description="anything else that locates the item")

    @field_validator("bin")
    @classmethod
    def _a_histogram_bin(cls, key: str | None) -> str | None:
        """The bins the histograms and the calls endpoint know (bin_spec's rule), no other."""
        if key is not None:
            bin_spec(key)
        return key


def _some_text(body: str | None) -> str | None:
    """A body of only white space says nothing (the dashboard refuses it; the API stored it as an empty item)."""
    if body is not None and not body.strip():
        raise ValueError("the body is only white space")
    return body


class ReviewCreate(StrictModel):
    body: str = Field(min_length=1, max_length=MAX_BODY, description="Markdown; raw HTML is shown as text")
    anchor: Anchor | None = None
    parent_id: int | None = Field(default=None, description="reply to this item")

    _body = field_validator("body")(_some_text)


class ReviewUpdate(StrictModel):
    body: str | None = Field(default=None, min_length=1, max_length=MAX_BODY)
    status: Literal["open", "resolved"] | None = None
    anchor: Anchor | None = Field(default=None, description="null or {} removes the item's anchor; absent keeps it")

    _body = field_validator("body")(_some_text)


class ReviewItem(BaseModel):
    item_id: int
    run: str
    parent_id: int | None
    author: str = Field(description="the author's user name; the name stored with the item once the user is deleted")
    author_id: int | None = Field(
        default=None, description="the author's user id; null for the tokenless local user and anonymous writers"
    )
    author_removed: bool = Field(
        default=False, description="the author is no longer a user: only an admin edits or deletes the item"
    )
    body: str
    body_html: str
    status: Literal["open", "resolved"]
    anchor: Anchor | None
    finding: str | None
    created_at: datetime
    updated_at: datetime
    replies: list[ReviewItem] = Field(
        default_factory=list,
        description=f"the first replies, oldest first (at most {INLINE_REPLIES}); "
        "GET /api/review/{item_id}/replies pages through all of them",
    )
    replies_total: int = 0
