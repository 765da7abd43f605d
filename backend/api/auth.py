"""Bearer tokens, users and who may do what.

Tokens are 32 random bytes (url-safe base64 with a `cl_` prefix), shown once; the store keeps only
their sha256. Without a token: a loopback client of a loopback-bound server is the local admin
("local"); elsewhere a tokenless request may read, and may write only when the server was started
with --insecure. Deleting runs and managing users needs an admin.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

import duckdb
from fastapi import Request

from commlens.contract.access import is_loopback

from .errors import ApiError

LOCAL_USER = "local"
ANONYMOUS = "anonymous"
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Principal:
    name: str
    is_admin: bool
    can_write: bool
    via: str  # token | loopback | anonymous


def new_token() -> str:
    return "cl_" + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_user_name(name: str) -> str:
    if not USER_NAME.match(name) or name in (LOCAL_USER, ANONYMOUS):
        raise ValueError(f"user name {name!r} must be 1-64 letters, digits, '.', '_' or '-', start with a letter or "
                         f"digit, and not be '{LOCAL_USER}' or '{ANONYMOUS}'")
    return name


def add_user(con: duckdb.DuckDBPyConnection, name: str, admin: bool = False) -> str:
    """Create a user and return its token (the only time it is visible)."""
    check_user_name(name)
    if con.execute("SELECT 1 FROM users WHERE name = ?", [name]).fetchone():
        raise ValueError(f"user {name!r} exists already; rotate its token instead")
    token = new_token()
    con.execute("INSERT INTO users (name, is_admin, token_hash) VALUES (?, ?, ?)", [name, admin, hash_token(token)])
    return token


MIN_ADMIN_TOKEN_CHARS = 24


def ensure_admin(con: duckdb.DuckDBPyConnection, name: str, token: str) -> bool:
    """Make `name` an admin whose token is `token`, a deployment's own secret (COMMLENS_ADMIN_TOKEN): the
    user is created, or its token and role replaced. True when the user was created."""
    check_user_name(name)
    if len(token) < MIN_ADMIN_TOKEN_CHARS or token != token.strip():
        raise ValueError(f"the admin token must be at least {MIN_ADMIN_TOKEN_CHARS} characters without surrounding "
                         "white space: a long random secret, e.g. from "
                         "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
    if con.execute("UPDATE users SET token_hash = ?, is_admin = true WHERE name = ? RETURNING name",
                   [hash_token(token), name]).fetchall():
        return False
    con.execute("INSERT INTO users (name, is_admin, token_hash) VALUES (?, true, ?)", [name, hash_token(token)])
    return True


def rotate_token(con: duckdb.DuckDBPyConnection, name: str) -> str:
    token = new_token()
    done = con.execute("UPDATE users SET token_hash = ? WHERE name = ? RETURNING name", [hash_token(token), name]).fetchall()
    if not done:
        raise LookupError(f"no user named {name!r}")
    return token


def user_count(con: duckdb.DuckDBPyConnection) -> int:
    return con.execute("SELECT count(*) FROM users").fetchone()[0]


def principal_for(request: Request, con: duckdb.DuckDBPyConnection, loopback_bind: bool, insecure: bool) -> Principal:
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "the Authorization header must be 'Bearer <token>'", "unauthenticated",
                           headers={"WWW-Authenticate": "Bearer"})
        row = con.execute("SELECT name, is_admin FROM users WHERE token_hash = ?", [hash_token(token.strip())]).fetchone()
        if row is None:
            raise ApiError(401, "unknown or revoked token; ask an admin for a new one (commlens users add NAME)",
                           "unauthenticated", headers={"WWW-Authenticate": "Bearer"})
        return Principal(row[0], bool(row[1]), True, "token")
    client = request.client.host if request.client else ""
    if loopback_bind and is_loopback(client):
        return Principal(LOCAL_USER, True, True, "loopback")
    return Principal(ANONYMOUS, False, insecure, "anonymous")


def require_write(p: Principal) -> Principal:
    if not p.can_write:
        raise ApiError(401, "this server is reachable from the network: writes need a token "
                       "(header 'Authorization: Bearer <token>'; an admin creates one with `commlens users add NAME`)",
                       "unauthenticated", headers={"WWW-Authenticate": "Bearer"})
    return p


def require_admin(p: Principal) -> Principal:
    require_write(p)
    if not p.is_admin:
        raise ApiError(403, f"user {p.name!r} is not an admin; only admins delete runs and manage users", "forbidden")
    return p
