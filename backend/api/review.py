"""Review items: comments anchored to a run and a view (scheme, op, bin, rank, free text), replies,
status open/resolved. Bodies are Markdown stored as text and served also as safe HTML."""

from __future__ import annotations

from typing import Annotated, Any

import duckdb
from fastapi import APIRouter, Query, Response
from pydantic import ValidationError

from commlens.contract.common import MAX_RANK, Page
from commlens.contract.review import INLINE_REPLIES, Anchor, ReviewCreate, ReviewItem, ReviewUpdate
from commlens.service import review as service
from commlens.vocab import Op

from .auth import Principal
from .deps import Cursor, Limit, Offset, Writer, next_offset
from .errors import problem_responses
from .markdown import render

router = APIRouter(tags=["review"])


def _anchor(anchor: dict[str, Any] | None) -> Anchor | None:
    """The stored anchor; fields that no longer validate (stored before a bound existed) are dropped."""
    if not anchor:
        return None
    try:
        return Anchor.model_validate(anchor)
    except ValidationError as exc:
        bad = {e["loc"][0] for e in exc.errors() if e["loc"]}
        return Anchor.model_validate({k: v for k, v in anchor.items() if k not in bad})


def review_item(item: dict[str, Any]) -> ReviewItem:
    """The wire form of a service item: its anchor checked, its body also as safe HTML."""
    replies = [review_item(r) for r in item.get("replies", [])]
    fields = {k: v for k, v in item.items() if k not in ("anchor", "replies")}
    return ReviewItem(**fields, body_html=render(item["body"]), anchor=_anchor(item["anchor"]), replies=replies)


def create_item(
    cur: duckdb.DuckDBPyConnection,
    run: str,
    author: Principal,
    body: str,
    anchor: Anchor | None,
    parent_id: int | None = None,
    finding: str | None = None,
) -> ReviewItem:
    item_id = service.create_item(
        cur, run, author.actor, body, anchor.model_dump(exclude_none=True) if anchor else None, parent_id, finding
    )
    return review_item(service.get_item(cur, item_id, INLINE_REPLIES))


@router.get(
    "/runs/{run}/review",
    response_model=Page[ReviewItem],
    responses=problem_responses(404),
    summary="Top-level review items of a run, newest first, with their replies",
)
def list_items(
    run: str,
    cur: Cursor,
    limit: Limit = 50,
    offset: Offset = 0,
    status: Annotated[str | None, Query(pattern="^(open|resolved)$")] = None,
    view: Annotated[str | None, Query(max_length=64)] = None,
    scheme: Annotated[str | None, Query(pattern="^(dp|tp|pp|cp|ep|other)$")] = None,
    op: Annotated[Op | None, Query()] = None,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK)] = None,
    finding: Annotated[str | None, Query(max_length=200)] = None,
) -> Page[ReviewItem]:
    items, total = service.list_items(
        cur,
        run,
        limit,
        offset,
        INLINE_REPLIES,
        status=status,
        anchor={"view": view, "scheme": scheme, "op": op},
        rank=rank,
        finding=finding,
    )
    return Page[ReviewItem](
        items=[review_item(i) for i in items],
        total=total,
        limit=limit,
        offset=offset,
        next_offset=next_offset(offset, limit, total),
    )


@router.get(
    "/review/{item_id}/replies",
    response_model=Page[ReviewItem],
    responses=problem_responses(404),
    summary="The replies to a review item, oldest first",
)
def list_replies(item_id: int, cur: Cursor, limit: Limit = 50, offset: Offset = 0) -> Page[ReviewItem]:
    items, total = service.list_replies(cur, item_id, limit, offset)
    return Page[ReviewItem](
        items=[review_item(i) for i in items],
        total=total,
        limit=limit,
        offset=offset,
        next_offset=next_offset(offset, limit, total),
    )


@router.post(
    "/runs/{run}/review", response_model=ReviewItem, status_code=201, responses=problem_responses(401, 404, 422)
)
def add_item(run: str, body: ReviewCreate, cur: Cursor, who: Writer) -> ReviewItem:
    return create_item(cur, run, who, body.body, body.anchor, body.parent_id)


@router.get("/review/{item_id}", response_model=ReviewItem, responses=problem_responses(404))
def read_item(item_id: int, cur: Cursor) -> ReviewItem:
    return review_item(service.get_item(cur, item_id, INLINE_REPLIES))


@router.patch("/review/{item_id}", response_model=ReviewItem, responses=problem_responses(401, 403, 404, 422))
def update_item(item_id: int, body: ReviewUpdate, cur: Cursor, who: Writer) -> ReviewItem:
    changes = {f: getattr(body, f) for f in body.model_fields_set}
    if "anchor" in changes:
        changes["anchor"] = body.anchor.model_dump(exclude_none=True) if body.anchor else None
    service.update_item(cur, item_id, who.actor, changes)
    return review_item(service.get_item(cur, item_id, INLINE_REPLIES))


@router.delete(
    "/review/{item_id}",
    status_code=204,
    responses=problem_responses(401, 403, 404, 409),
    summary="Delete a review item and its replies; a non-admin deletes no other author's reply (409)",
)
def delete_item(item_id: int, cur: Cursor, who: Writer) -> Response:
    service.delete_item(cur, item_id, who.actor)
    return Response(status_code=204)
