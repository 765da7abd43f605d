"""Users and their API tokens.

Tokens are 32 random bytes (url-safe base64 with a `cl_` prefix), shown once; the store keeps only
their sha256.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

import duckdb

from commlens.store import transaction

from .errors import ConflictError, InvalidError, NotFoundError

LOCAL_USER = "local"
ANONYMOUS = "anonymous"
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MIN_ADMIN_TOKEN_CHARS = 24
WRITE_ATTEMPTS = 5


@dataclass(frozen=True)
class User:
    name: str
    is_admin: bool
    created_at: datetime


def new_token() -> str:
    return "cl_" + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_user_name(name: str) -> str:
    if not USER_NAME.match(name) or name in (LOCAL_USER, ANONYMOUS):
        raise InvalidError(
            f"user name {name!r} must be 1-64 letters, digits, '.', '_' or '-', start with a letter or "
            f"digit, and not be '{LOCAL_USER}' or '{ANONYMOUS}'",
            "invalid-user-name",
        )
    return name


def add_user(con: duckdb.DuckDBPyConnection, name: str, admin: bool = False) -> str:
    """Create a user and return its token (the only time it is visible)."""
    check_user_name(name)
    token = new_token()

    def add(c: duckdb.DuckDBPyConnection) -> None:
        if c.execute("SELECT 1 FROM users WHERE name = ?", [name]).fetchall():
            raise ConflictError(f"user {name!r} exists already; rotate its token instead", "user-exists")
        c.execute("INSERT INTO users (name, is_admin, token_hash) VALUES (?, ?, ?)", [name, admin, hash_token(token)])

    transaction(con, add, WRITE_ATTEMPTS)
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

    return transaction(con, upsert, WRITE_ATTEMPTS)


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


def remove_user(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Delete a user: its token stops working."""

    def remove(c: duckdb.DuckDBPyConnection) -> None:
        if not c.execute("DELETE FROM users WHERE name = ? RETURNING name", [name]).fetchall():
            raise NotFoundError(f"no user named {name!r}", "unknown-user")

    transaction(con, remove, WRITE_ATTEMPTS)


def user_count(con: duckdb.DuckDBPyConnection) -> int:
    return int(con.execute("SELECT count(*) FROM users").fetchall()[0][0])


def list_users(con: duckdb.DuckDBPyConnection, limit: int | None = None, offset: int = 0) -> list[User]:
    """Users by name (never their tokens)."""
    rows = con.execute(
        "SELECT name, is_admin, created_at FROM users ORDER BY name LIMIT ? OFFSET ?", [limit, offset]
    ).fetchall()
    return [User(r[0], bool(r[1]), r[2]) for r in rows]


def user_by_token(con: duckdb.DuckDBPyConnection, token: str) -> User | None:
    """The user holding this token, if any."""
    rows = con.execute(
        "SELECT name, is_admin, created_at FROM users WHERE token_hash = ?", [hash_token(token)]
    ).fetchall()
    return User(rows[0][0], bool(rows[0][1]), rows[0][2]) if rows else None
