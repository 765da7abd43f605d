"""Who the caller is (bearer token, loopback, anonymous) and what they may do.

Users and tokens live in commlens.service.users. Without a token: a loopback client of a loopback-bound
server is the local admin ("local"); elsewhere a tokenless request may read, and may write only when the server was started
with --insecure. Deleting runs and managing users needs an admin; renaming a run, its owner or an admin; editing a
review item, its author or an admin (both by user id, `Principal.actor`).
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
from fastapi import Request

from commlens.contract.access import is_loopback
from commlens.service.users import ANONYMOUS, LOCAL_USER, Actor, user_by_token

from .errors import ApiError


@dataclass(frozen=True)
class Principal:
    name: str
    is_admin: bool
    can_write: bool
    via: str  # token | loopback | anonymous
    user_id: int | None = None  # the token's user; None for the local user and anonymous callers

    @property
    def actor(self) -> Actor:
        """Who the service sees acting: owners and authors are matched by user id."""
        return Actor(self.name, self.user_id, self.is_admin)


def principal_for(request: Request, con: duckdb.DuckDBPyConnection, loopback_bind: bool, insecure: bool) -> Principal:
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401,
                "the Authorization header must be 'Bearer <token>'",
                "unauthenticated",
                headers={"WWW-Authenticate": "Bearer"},
            )
        user = user_by_token(con, token.strip())
        if user is None:
            raise ApiError(
                401,
                "unknown or revoked token; ask an admin for a new one (commlens users add NAME)",
                "unauthenticated",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return Principal(user.name, user.is_admin, True, "token", user.user_id)
    client = request.client.host if request.client else ""
    if loopback_bind and is_loopback(client):
        return Principal(LOCAL_USER, True, True, "loopback")
    return Principal(ANONYMOUS, False, insecure, "anonymous")


def require_write(p: Principal, what: str = "writes need a token") -> Principal:
    if not p.can_write:
        raise ApiError(
            401,
            f"this server is reachable from the network: {what} "
            "(header 'Authorization: Bearer <token>'; an admin creates one with `commlens users add NAME`)",
            "unauthenticated",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return p


def require_admin(p: Principal) -> Principal:
    require_write(p, "this request needs an admin's token")
    if not p.is_admin:
        raise ApiError(403, f"user {p.name!r} is not an admin; only admins delete runs and manage users", "forbidden")
    return p
