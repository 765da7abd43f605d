"""Per-request dependencies: the application context, a cursor, the caller."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import duckdb
from fastapi import Depends, Query, Request

from . import auth
from .db import Database
from .settings import Settings

if TYPE_CHECKING:
    from .ingest_queue import IngestQueue


@dataclass
class AppContext:
    settings: Settings
    db: Database
    ingest_queue: IngestQueue


def get_ctx(request: Request) -> AppContext:
    return request.app.state.ctx


def get_cursor(ctx: Annotated[AppContext, Depends(get_ctx)]) -> Iterator[duckdb.DuckDBPyConnection]:
    with ctx.db.session() as cur:
        yield cur


Ctx = Annotated[AppContext, Depends(get_ctx)]
Cursor = Annotated[duckdb.DuckDBPyConnection, Depends(get_cursor)]


def get_principal(request: Request, ctx: Ctx, cur: Cursor) -> auth.Principal:
    return auth.principal_for(request, cur, ctx.settings.loopback, ctx.settings.insecure)


def get_writer(p: Annotated[auth.Principal, Depends(get_principal)]) -> auth.Principal:
    return auth.require_write(p)


def get_admin(p: Annotated[auth.Principal, Depends(get_principal)]) -> auth.Principal:
    return auth.require_admin(p)


Caller = Annotated[auth.Principal, Depends(get_principal)]
Writer = Annotated[auth.Principal, Depends(get_writer)]
Admin = Annotated[auth.Principal, Depends(get_admin)]

MAX_LIMIT = 1000
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="page size")]
Offset = Annotated[int, Query(ge=0, le=2**62, description="items to skip")]


def next_offset(offset: int, limit: int, total: int) -> int | None:
    return offset + limit if offset + limit < total else None
