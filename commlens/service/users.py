"""Users and their API tokens; who acts (`Actor`), and the rule that a store with users keeps an admin.

Tokens are 32 random bytes (url-safe base64 with a `cl_` prefix), shown once; the store keeps only
their sha256. Authorship and ownership are bound to `users.user_id`, never reused: a name freed by
deleting its user may be given again, and the new user gets none of the old one's items or runs.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import duckdb

from commlens.store import transaction
from commlens.store.transaction import NAME_RACES

from .errors import ConflictError, InvalidError, NotFoundError

LOCAL_USER = "local"
ANONYMOUS = "anonymous"
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MIN_ADMIN_TOKEN_CHARS = 24
WRITE_ATTEMPTS = 5
# Deleting and demoting admins check how many remain: DuckDB's optimistic transactions would let two of them
# commit together (each sees the other admin), and one process writes the store, so a lock orders them.
_ADMINS = threading.Lock()
_USER_COLS = "user_id, name, is_admin, created_at"


@dataclass(frozen=True)
class User:
    user_id: int
    name: str
    is_admin: bool
    created_at: datetime


@dataclass(frozen=True)
class Actor:
    """Who performs an operation: a user of the store, or the tokenless local user or an anonymous
    writer (`user_id` None), who own nothing by id."""

    name: str
    user_id: int | None
    is_admin: bool


def _user(row: tuple[Any, ...]) -> User:
    return User(int(row[0]), str(row[1]), bool(row[2]), row[3])


def new_token() -> str:
    return "cl_" + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_user_name(name: str) -> str:
    if not USER_NAME.fullmatch(name) or name.casefold() in (LOCAL_USER.casefold(), ANONYMOUS.casefold()):
        raise InvalidError(
            f"user name {name!r} must be 1-64 letters, digits, '.', '_' or '-', start with a letter or "
            f"digit, and not be '{LOCAL_USER}' or '{ANONYMOUS}' in any case",
            "invalid-user-name",
        )
    return name


def add_user(con: duckdb.DuckDBPyConnection, name: str, admin: bool = False) -> str:
    """Create a user and return its token (the only time it is visible)."""
    check_user_name(name)
    token = new_token()

    def add(c: duckdb.DuckDBPyConnection) -> None:
        same = c.execute("SELECT name FROM users WHERE lower(name) = lower(?)", [name]).fetchall()
        if same and same[0][0] == name:
            raise ConflictError(f"user {name!r} exists already; rotate its token instead", "user-exists")
        if same:  # 'Alice' beside 'alice' reads as the same person in review threads and run owners
            raise ConflictError(
                f"user {same[0][0]!r} exists already: names differing only in case are one name", "user-exists"
            )
        c.execute("INSERT INTO users (name, is_admin, token_hash) VALUES (?, ?, ?)", [name, admin, hash_token(token)])

    transaction(con, add, WRITE_ATTEMPTS, retry_on=NAME_RACES)
    return token


def ensure_admin(con: duckdb.DuckDBPyConnection, name: str, token: str) -> bool:
    """Make `name` an admin whose token is `token`, a deployment's own secret (COMMLENS_ADMIN_TOKEN): the
    user is created, or its token and role replaced. True when the user was created."""
    check_user_name(name)
    if len(token) < MIN_ADMIN_TOKEN_CHARS or token != token.strip():
        raise InvalidError(
            f"the admin token must be at least {MIN_ADMIN_TOKEN_CHARS} characters without surrounding "
            "white space: a long random secret, e.g. from "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'",
            "invalid-admin-token",
        )

    def upsert(c: duckdb.DuckDBPyConnection) -> bool:
        if c.execute(
            "UPDATE users SET token_hash = ?, is_admin = true WHERE name = ? RETURNING name", [hash_token(token), name]
        ).fetchall():
            return False
        c.execute("INSERT INTO users (name, is_admin, token_hash) VALUES (?, true, ?)", [name, hash_token(token)])
        return True

    return transaction(con, upsert, WRITE_ATTEMPTS, retry_on=NAME_RACES)


def rotate_token(con: duckdb.DuckDBPyConnection, name: str) -> tuple[str, bool]:
    """A new token for the user (the old one stops working) and whether the user is an admin."""
    token = new_token()

    def rotate(c: duckdb.DuckDBPyConnection) -> bool:
        rows = c.execute(
            "UPDATE users SET token_hash = ? WHERE name = ? RETURNING is_admin", [hash_token(token), name]
        ).fetchall()
        if not rows:
            raise NotFoundError(f"no user named {name!r}", "unknown-user")
        return bool(rows[0][0])

    return token, transaction(con, rotate, WRITE_ATTEMPTS)


def _check_admin_remains(c: duckdb.DuckDBPyConnection, name: str, action: str) -> None:
    """ConflictError when `name` is the store's only admin: without one nobody manages users over the API."""
    admins = [r[0] for r in c.execute("SELECT name FROM users WHERE is_admin").fetchall()]
    if admins == [name]:
        raise ConflictError(
            f"user {name!r} is the last admin; make another user an admin first, then {action} {name!r}",
            "last-admin",
        )


def remove_user(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Delete a user: its token stops working; its review items keep its name and no one edits them as their
    author; runs it owned are renamed by admins. The last admin is not deleted (ConflictError)."""

    def remove(c: duckdb.DuckDBPyConnection) -> None:
        if not c.execute("SELECT 1 FROM users WHERE name = ?", [name]).fetchall():
            raise NotFoundError(f"no user named {name!r}", "unknown-user")
        _check_admin_remains(c, name, "delete")
        c.execute("DELETE FROM users WHERE name = ?", [name])

    with _ADMINS:
        transaction(con, remove, WRITE_ATTEMPTS)


def set_admin(con: duckdb.DuckDBPyConnection, name: str, admin: bool) -> User:
    """Make a user an admin or not; the last admin is not demoted (ConflictError)."""

    def change(c: duckdb.DuckDBPyConnection) -> User:
        if not c.execute("SELECT 1 FROM users WHERE name = ?", [name]).fetchall():
            raise NotFoundError(f"no user named {name!r}", "unknown-user")
        if not admin:
            _check_admin_remains(c, name, "demote")
        rows = c.execute(f"UPDATE users SET is_admin = ? WHERE name = ? RETURNING {_USER_COLS}", [admin, name])
        return _user(rows.fetchall()[0])

    with _ADMINS:
        return transaction(con, change, WRITE_ATTEMPTS)


def user_count(con: duckdb.DuckDBPyConnection) -> int:
    return int(con.execute("SELECT count(*) FROM users").fetchall()[0][0])


def admin_count(con: duckdb.DuckDBPyConnection) -> int:
    return int(con.execute("SELECT count(*) FROM users WHERE is_admin").fetchall()[0][0])


def list_users(con: duckdb.DuckDBPyConnection, limit: int | None = None, offset: int = 0) -> list[User]:
    """Users by name (never their tokens)."""
    rows = con.execute(f"SELECT {_USER_COLS} FROM users ORDER BY name LIMIT ? OFFSET ?", [limit, offset]).fetchall()
    return [_user(r) for r in rows]


def user_by_token(con: duckdb.DuckDBPyConnection, token: str) -> User | None:
    """The user holding this token, if any."""
    rows = con.execute(f"SELECT {_USER_COLS} FROM users WHERE token_hash = ?", [hash_token(token)]).fetchall()
    return _user(rows[0]) if rows else None
