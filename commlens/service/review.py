"""Review items: comments anchored to a run and a view, replies one level deep, status open/resolved.

Items are plain dicts with the API's field names (`ReviewItem` less the rendered body); `anchor` is the
stored JSON object, `replies` the first `inline_replies` replies, oldest first. An item's author is a user
id (`author_id`): its name is read from the user, the name stored with the item once the user is deleted
(`author_removed`), and only that id (or an admin) edits it. The tokenless local user and anonymous
writers have no id; their items are theirs by name, which no user can have.
"""

from __future__ import annotations

import json
from typing import Any

import duckdb

from commlens.backend.iterations import run_id_of
from commlens.store import transaction

from .errors import ConflictError, ForbiddenError, InvalidError, NotFoundError
from .users import ANONYMOUS, LOCAL_USER, Actor
from .write_order import RUN_ROWS

WRITE_ATTEMPTS = 5
ANCHOR_KEYS = ("view", "scheme", "op")  # anchor fields a list filters on by equality
_REMOVED = f"""CASE WHEN i.author_id IS NULL THEN i.author NOT IN ('{LOCAL_USER}', '{ANONYMOUS}')
                ELSE u.user_id IS NULL END"""
_COLS = (
    "i.item_id, r.name, i.parent_id, coalesce(u.name, i.author), i.author_id, "
    f"{_REMOVED}, i.body, i.status, i.anchor, i.finding, i.created_at, i.updated_at"
)
_NAMES = (
    "item_id",
    "run",
    "parent_id",
    "author",
    "author_id",
    "author_removed",
    "body",
    "status",
    "anchor",
    "finding",
    "created_at",
    "updated_at",
)
_FROM = "review_items i JOIN runs r USING (run_id) LEFT JOIN users u ON u.user_id = i.author_id"


def _json(anchor: dict[str, Any] | None) -> str | None:
    return json.dumps(anchor, separators=(",", ":")) if anchor else None


def _item(row: tuple[Any, ...]) -> dict[str, Any]:
    item = dict(zip(_NAMES, row, strict=True))
    anchor = json.loads(item["anchor"]) if isinstance(item["anchor"], str) else item["anchor"]
    item["anchor"] = anchor if isinstance(anchor, dict) and anchor else None
    return item


def _with_replies(con: duckdb.DuckDBPyConnection, items: list[dict[str, Any]], inline: int) -> list[dict[str, Any]]:
    """Each item's first `inline` replies (oldest first) and its number of replies."""
    for item in items:
        item["replies"], item["replies_total"] = [], 0
    if not items:
        return items
    rows = con.execute(
        f"""SELECT * FROM (
                SELECT {_COLS}, row_number() OVER w AS nth, count(*) OVER (PARTITION BY i.parent_id) AS n
                FROM {_FROM} WHERE list_contains(?, i.parent_id)
                WINDOW w AS (PARTITION BY i.parent_id ORDER BY i.item_id))
            WHERE nth <= ? ORDER BY item_id""",
        [[i["item_id"] for i in items], inline],
    ).fetchall()
    by_parent = {i["item_id"]: i for i in items}
    for r in rows:
        parent = by_parent[r[2]]
        parent["replies"].append(_item(r[: len(_NAMES)]))
        parent["replies_total"] = r[-1]
    return items


def get_item(con: duckdb.DuckDBPyConnection, item_id: int, inline: int | None = None) -> dict[str, Any]:
    """The item, with its first `inline` replies when given."""
    rows = con.execute(f"SELECT {_COLS} FROM {_FROM} WHERE i.item_id = ?", [item_id]).fetchall()
    if not rows:
        raise NotFoundError(f"no review item {item_id}", "unknown-review-item")
    item = _item(rows[0])
    return _with_replies(con, [item], inline)[0] if inline is not None else item


def create_item(
    con: duckdb.DuckDBPyConnection,
    run: str,
    author: Actor,
    body: str,
    anchor: dict[str, Any] | None,
    parent_id: int | None = None,
    finding: str | None = None,
) -> int:
    """A new item (a reply when parent_id is given: it hangs under the top-level item); its id. A finding
    is promoted once: ConflictError when it is a top-level item of the run already."""

    def insert(c: duckdb.DuckDBPyConnection) -> int:
        run_id = run_id_of(c, run)
        parent = parent_id
        if parent is not None:
            rows = c.execute("SELECT run_id, parent_id FROM review_items WHERE item_id = ?", [parent]).fetchall()
            if not rows or rows[0][0] != run_id:
                raise InvalidError(f"parent_id {parent} is not a review item of run {run!r}", "unknown-parent")
            parent = rows[0][1] if rows[0][1] is not None else parent
        if finding is not None and parent is None:
            promoted = c.execute(
                "SELECT item_id FROM review_items WHERE run_id = ? AND finding = ? AND parent_id IS NULL",
                [run_id, finding],
            ).fetchall()
            if promoted:
                raise ConflictError(f"finding {finding!r} is review item {promoted[0][0]} already", "finding-promoted")
        rows = c.execute(
            "INSERT INTO review_items (run_id, parent_id, author, author_id, body, anchor, finding) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING item_id",
            [run_id, parent, author.name, author.user_id, body, _json(anchor), finding],
        ).fetchall()
        return int(rows[0][0])

    with RUN_ROWS:  # the parent, the run and a promoted finding are checked before the INSERT
        return transaction(con, insert, WRITE_ATTEMPTS)


def list_items(
    con: duckdb.DuckDBPyConnection,
    run: str,
    limit: int,
    offset: int,
    inline: int,
    status: str | None = None,
    anchor: dict[str, Any] | None = None,
    rank: int | None = None,
    finding: str | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """A page of the run's top-level items, newest first, matching a status, anchor fields (ANCHOR_KEYS),
    an anchored rank and a finding; and how many match."""
    run_id = run_id_of(con, run)
    conditions = ["i.run_id = ?", "i.parent_id IS NULL"]
    params: list[Any] = [run_id]
    if status:
        conditions.append("i.status = ?")
        params.append(status)
    for key in ANCHOR_KEYS:
        value = (anchor or {}).get(key)
        if value is not None:
            conditions.append(f"json_extract_string(i.anchor, '$.{key}') = ?")  # key from the fixed tuple
            params.append(value)
    if rank is not None:
        conditions.append("TRY_CAST(json_extract(i.anchor, '$.rank') AS BIGINT) = ?")
        params.append(rank)
    if finding is not None:
        conditions.append("i.finding = ?")
        params.append(finding)
    where = "WHERE " + " AND ".join(conditions)
    total = int(con.execute(f"SELECT count(*) FROM review_items i {where}", params).fetchall()[0][0])
    rows = con.execute(
        f"SELECT {_COLS} FROM {_FROM} {where} ORDER BY i.created_at DESC, i.item_id DESC LIMIT ? OFFSET ?",
        [*params, limit, offset],
    ).fetchall()
    return _with_replies(con, [_item(r) for r in rows], inline), total


def list_replies(
    con: duckdb.DuckDBPyConnection, item_id: int, limit: int, offset: int
) -> tuple[list[dict[str, Any]], int]:
    """A page of an item's replies, oldest first, and how many it has."""
    get_item(con, item_id)  # NotFoundError for an unknown item
    total = int(con.execute("SELECT count(*) FROM review_items WHERE parent_id = ?", [item_id]).fetchall()[0][0])
    rows = con.execute(
        f"SELECT {_COLS} FROM {_FROM} WHERE i.parent_id = ? ORDER BY i.item_id LIMIT ? OFFSET ?",
        [item_id, limit, offset],
    ).fetchall()
    return [_item(r) for r in rows], total


def _is_authors(who: Actor, author: str, author_id: int | None) -> bool:
    """Whether `who` wrote an item: by user id; the tokenless local user and anonymous writers, who have no id,
    by name (no user can have theirs)."""
    if author_id is not None:
        return author_id == who.user_id
    return who.user_id is None and author == who.name


def _check_author(c: duckdb.DuckDBPyConnection, item_id: int, who: Actor, action: str) -> None:
    rows = c.execute(
        "SELECT i.author, i.author_id, u.user_id IS NOT NULL FROM review_items i "
        "LEFT JOIN users u ON u.user_id = i.author_id WHERE i.item_id = ?",
        [item_id],
    ).fetchall()
    if not rows:
        raise NotFoundError(f"no review item {item_id}", "unknown-review-item")
    author, author_id, exists = rows[0]
    if who.is_admin or _is_authors(who, author, author_id):
        return
    if (author_id is not None and not exists) or (author_id is None and author not in (LOCAL_USER, ANONYMOUS)):
        raise ForbiddenError(
            f"item {item_id}'s author, a former user named {author!r}, is no longer a user (a user given the name "
            f"since is another one); only an admin may {action} it",
            "forbidden",
        )
    raise ForbiddenError(f"only {author!r} (the author) or an admin may {action} item {item_id}", "forbidden")


def update_item(con: duckdb.DuckDBPyConnection, item_id: int, who: Actor, changes: dict[str, Any]) -> None:
    """Apply body, status and anchor changes; body and anchor are the author's (or an admin's), status anyone's.
    A null body or status is refused (it changed nothing, silently); a null anchor removes the anchor."""
    for col in ("body", "status"):
        if col in changes and changes[col] is None:
            raise InvalidError(f"{col} cannot be null; leave it out to keep the item's {col}", "invalid-request")

    def update(c: duckdb.DuckDBPyConnection) -> None:
        if changes.keys() & {"body", "anchor"}:
            _check_author(c, item_id, who, "edit")
        elif not c.execute("SELECT 1 FROM review_items WHERE item_id = ?", [item_id]).fetchall():
            raise NotFoundError(f"no review item {item_id}", "unknown-review-item")
        sets: list[str] = []
        params: list[Any] = []
        for col in ("body", "status"):
            if col in changes:
                sets.append(f"{col} = ?")
                params.append(changes[col])
        if "anchor" in changes:
            sets.append("anchor = ?")
            params.append(_json(changes["anchor"]))
        if sets:
            c.execute(
                f"UPDATE review_items SET {', '.join(sets)}, updated_at = current_timestamp WHERE item_id = ?",
                [*params, item_id],
            )

    transaction(con, update, WRITE_ATTEMPTS)


def _check_replies_are_the_callers(c: duckdb.DuckDBPyConnection, item_id: int, who: Actor) -> None:
    """ConflictError when a non-admin would delete, with their item, replies of other authors: a reply is its
    author's (or an admin's) to delete."""
    if who.is_admin:
        return
    rows = c.execute("SELECT author, author_id FROM review_items WHERE parent_id = ?", [item_id]).fetchall()
    others = [(author_id, author) for author, author_id in rows if not _is_authors(who, author, author_id)]
    if others:
        n, authors = len(others), len({author if author_id is None else author_id for author_id, author in others})
        raise ConflictError(
            f"item {item_id} has {n} {'reply' if n == 1 else 'replies'} by "
            f"{'another author' if authors == 1 else f'{authors} other authors'}, which only their authors or an "
            "admin may delete; ask them or an admin to delete those replies first, or resolve the item instead",
            "has-replies-of-others",
        )


def delete_item(con: duckdb.DuckDBPyConnection, item_id: int, who: Actor) -> None:
    """Delete an item and its replies (the author's or an admin's). A non-admin deletes no other author's reply:
    ConflictError when the item has any (docs/security.md)."""

    def delete(c: duckdb.DuckDBPyConnection) -> None:
        _check_author(c, item_id, who, "delete")
        _check_replies_are_the_callers(c, item_id, who)
        c.execute("DELETE FROM review_items WHERE item_id = ? OR parent_id = ?", [item_id, item_id])

    with RUN_ROWS:
        transaction(con, delete, WRITE_ATTEMPTS)
