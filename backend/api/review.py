"""Review items: comments anchored to a run and a view (scheme, op, bin, rank, free text), replies,
status open/resolved. Bodies are Markdown stored as text and served also as safe HTML."""

from __future__ import annotations

import json
from typing import Annotated, Any

import duckdb
from fastapi import APIRouter, Query, Response
from pydantic import ValidationError

from commlens.backend.iterations import run_id_of
from commlens.contract.common import MAX_RANK, Page
from commlens.contract.review import INLINE_REPLIES, Anchor, ReviewCreate, ReviewItem, ReviewUpdate
from commlens.vocab import Op

from .auth import Principal
from .db import transaction
from .deps import Cursor, Limit, Offset, Writer, next_offset
from .errors import ApiError, problem_responses
from .markdown import render

router = APIRouter(tags=["review"])

_COLS = "i.item_id, r.name, i.parent_id, i.author, i.body, i.status, i.anchor, i.finding, i.created_at, i.updated_at"


def _anchor(raw: Any) -> Anchor | None:
    """The stored anchor; fields that no longer validate (stored before a bound existed) are dropped."""
    anchor = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(anchor, dict) or not anchor:
        return None
    try:
        return Anchor.model_validate(anchor)
    except ValidationError as exc:
        bad = {e["loc"][0] for e in exc.errors() if e["loc"]}
        return Anchor.model_validate({k: v for k, v in anchor.items() if k not in bad})


def _item(row: tuple) -> ReviewItem:
    return ReviewItem(item_id=row[0], run=row[1], parent_id=row[2], author=row[3], body=row[4], body_html=render(row[4]),
                      status=row[5], anchor=_anchor(row[6]), finding=row[7], created_at=row[8], updated_at=row[9])


def _with_replies(cur: duckdb.DuckDBPyConnection, items: list[ReviewItem]) -> list[ReviewItem]:
    """Each item's first INLINE_REPLIES replies (oldest first) and its number of replies."""
    if not items:
        return items
    rows = cur.execute(
        f"""SELECT * FROM (
                SELECT {_COLS}, row_number() OVER w AS nth, count(*) OVER (PARTITION BY i.parent_id) AS n
                FROM review_items i JOIN runs r USING (run_id) WHERE list_contains(?, i.parent_id)
                WINDOW w AS (PARTITION BY i.parent_id ORDER BY i.item_id))
            WHERE nth <= ? ORDER BY item_id""", [[i.item_id for i in items], INLINE_REPLIES]).fetchall()
    by_parent = {i.item_id: i for i in items}
    for r in rows:
        parent = by_parent[r[2]]
        parent.replies.append(_item(r))
        parent.replies_total = r[-1]
    return items


def get_item(cur: duckdb.DuckDBPyConnection, item_id: int, with_replies: bool = True) -> ReviewItem:
    row = cur.execute(f"SELECT {_COLS} FROM review_items i JOIN runs r USING (run_id) WHERE i.item_id = ?",
                      [item_id]).fetchone()
    if row is None:
        raise ApiError(404, f"no review item {item_id}", "unknown-review-item")
    item = _item(row)
    return _with_replies(cur, [item])[0] if with_replies else item


def create_item(cur: duckdb.DuckDBPyConnection, run: str, author: str, body: str, anchor: Anchor | None,
                parent_id: int | None = None, finding: str | None = None) -> ReviewItem:
    def insert(c: duckdb.DuckDBPyConnection) -> int:
        run_id = run_id_of(c, run)
        parent = parent_id
        if parent is not None:
            row = c.execute("SELECT run_id, parent_id FROM review_items WHERE item_id = ?", [parent]).fetchone()
            if row is None or row[0] != run_id:
                raise ApiError(422, f"parent_id {parent} is not a review item of run {run!r}", "unknown-parent")
            parent = row[1] if row[1] is not None else parent  # replies hang under the top-level item
        return c.execute(
            "INSERT INTO review_items (run_id, parent_id, author, body, anchor, finding) VALUES (?, ?, ?, ?, ?, ?) "
            "RETURNING item_id",
            [run_id, parent, author, body, anchor.model_dump_json(exclude_none=True) if anchor else None, finding],
        ).fetchone()[0]

    return get_item(cur, transaction(cur, insert))


@router.get("/runs/{run}/review", response_model=Page[ReviewItem], responses=problem_responses(404),
            summary="Top-level review items of a run, newest first, with their replies")
def list_items(
    run: str, cur: Cursor, limit: Limit = 50, offset: Offset = 0,
    status: Annotated[str | None, Query(pattern="^(open|resolved)$")] = None,
    view: Annotated[str | None, Query(max_length=64)] = None,
    scheme: Annotated[str | None, Query(pattern="^(dp|tp|pp|cp|ep|other)$")] = None,
    op: Annotated[Op | None, Query()] = None,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK)] = None,
    finding: Annotated[str | None, Query(max_length=200)] = None,
) -> Page[ReviewItem]:
    run_id = run_id_of(cur, run)
    conditions, params = ["i.run_id = ?", "i.parent_id IS NULL"], [run_id]
    if status:
        conditions.append("i.status = ?")
        params.append(status)
    for key, value in (("view", view), ("scheme", scheme), ("op", op)):
        if value is not None:
            conditions.append(f"json_extract_string(i.anchor, '$.{key}') = ?")  # key from the fixed tuple above
            params.append(value)
    if rank is not None:
        conditions.append("TRY_CAST(json_extract(i.anchor, '$.rank') AS BIGINT) = ?")
        params.append(rank)
    if finding is not None:
        conditions.append("i.finding = ?")
        params.append(finding)
    where = "WHERE " + " AND ".join(conditions)
    total = cur.execute(f"SELECT count(*) FROM review_items i {where}", params).fetchone()[0]
    rows = cur.execute(f"SELECT {_COLS} FROM review_items i JOIN runs r USING (run_id) {where} "
                       "ORDER BY i.created_at DESC, i.item_id DESC LIMIT ? OFFSET ?", params + [limit, offset]).fetchall()
    items = _with_replies(cur, [_item(r) for r in rows])
    return Page[ReviewItem](items=items, total=total, limit=limit, offset=offset, next_offset=next_offset(offset, limit, total))


@router.get("/review/{item_id}/replies", response_model=Page[ReviewItem], responses=problem_responses(404),
            summary="The replies to a review item, oldest first")
def list_replies(item_id: int, cur: Cursor, limit: Limit = 50, offset: Offset = 0) -> Page[ReviewItem]:
    get_item(cur, item_id, with_replies=False)  # 404 for an unknown item
    total = cur.execute("SELECT count(*) FROM review_items WHERE parent_id = ?", [item_id]).fetchone()[0]
    rows = cur.execute(f"SELECT {_COLS} FROM review_items i JOIN runs r USING (run_id) WHERE i.parent_id = ? "
                       "ORDER BY i.item_id LIMIT ? OFFSET ?", [item_id, limit, offset]).fetchall()
    return Page[ReviewItem](items=[_item(r) for r in rows], total=total, limit=limit, offset=offset,
                            next_offset=next_offset(offset, limit, total))


@router.post("/runs/{run}/review", response_model=ReviewItem, status_code=201, responses=problem_responses(401, 404, 422))
def add_item(run: str, body: ReviewCreate, cur: Cursor, who: Writer) -> ReviewItem:
    return create_item(cur, run, who.name, body.body, body.anchor, body.parent_id)


@router.get("/review/{item_id}", response_model=ReviewItem, responses=problem_responses(404))
def read_item(item_id: int, cur: Cursor) -> ReviewItem:
    return get_item(cur, item_id)


def _owned(c: duckdb.DuckDBPyConnection, item_id: int, who: Principal, action: str) -> None:
    row = c.execute("SELECT author FROM review_items WHERE item_id = ?", [item_id]).fetchone()
    if row is None:
        raise ApiError(404, f"no review item {item_id}", "unknown-review-item")
    if row[0] != who.name and not who.is_admin:
        raise ApiError(403, f"only {row[0]!r} (the author) or an admin may {action} item {item_id}", "forbidden")


@router.patch("/review/{item_id}", response_model=ReviewItem, responses=problem_responses(401, 403, 404, 422))
def update_item(item_id: int, body: ReviewUpdate, cur: Cursor, who: Writer) -> ReviewItem:
    fields = body.model_fields_set

    def update(c: duckdb.DuckDBPyConnection) -> None:
        if fields & {"body", "anchor"}:
            _owned(c, item_id, who, "edit")
        elif not c.execute("SELECT 1 FROM review_items WHERE item_id = ?", [item_id]).fetchone():
            raise ApiError(404, f"no review item {item_id}", "unknown-review-item")
        sets: list[str] = []
        params: list[Any] = []
        if "body" in fields and body.body is not None:
            sets.append("body = ?")
            params.append(body.body)
        if "status" in fields and body.status is not None:
            sets.append("status = ?")
            params.append(body.status)
        if "anchor" in fields:
            sets.append("anchor = ?")
            params.append(body.anchor.model_dump_json(exclude_none=True) if body.anchor else None)
        if sets:
            c.execute(f"UPDATE review_items SET {', '.join(sets)}, updated_at = current_timestamp WHERE item_id = ?",
                      params + [item_id])

    transaction(cur, update)
    return get_item(cur, item_id)


@router.delete("/review/{item_id}", status_code=204, responses=problem_responses(401, 403, 404))
def delete_item(item_id: int, cur: Cursor, who: Writer) -> Response:
    def delete(c: duckdb.DuckDBPyConnection) -> None:
        _owned(c, item_id, who, "delete")
        c.execute("DELETE FROM review_items WHERE item_id = ? OR parent_id = ?", [item_id, item_id])

    transaction(cur, delete)
    return Response(status_code=204)
