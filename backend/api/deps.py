"""Per-request dependencies: the application context, a cursor, the caller."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import duckdb
from fastapi import Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from commlens.contract.common import MAX_RANK

from . import auth
from .db import Database
from .errors import ApiError
from .settings import Settings

if TYPE_CHECKING:
    from fastapi.dependencies.models import Dependant

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


@dataclass(frozen=True)
class RankRange:
    """The global ranks [first, last] a list is restricted to; None: unbounded on that side."""

    first: int | None
    last: int | None


def get_rank_range(
    first: Annotated[int | None, Query(ge=0, le=MAX_RANK, description="lowest global rank of the rows")] = None,
    last: Annotated[int | None, Query(ge=0, le=MAX_RANK, description="highest global rank of the rows")] = None,
) -> RankRange:
    """`first` and `last` of every route taking a range of ranks; an inverted range is the request's mistake
    (422 naming both fields, as a bad field is named), not an empty answer."""
    if first is not None and last is not None and first > last:
        raise RequestValidationError(
            [
                {"type": "value_error", "loc": ("query", "first"), "msg": f"must be at most last ({last})"},
                {"type": "value_error", "loc": ("query", "last"), "msg": f"must be at least first ({first})"},
            ]
        )
    return RankRange(first, last)


Ranks = Annotated[RankRange, Depends(get_rank_range)]


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route reads, its dependencies' included."""
    names = {f.alias for f in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


_KNOWN_QUERY: dict[str, frozenset[str]] = {}  # route path and methods -> its query parameters


def single_query_values(request: Request) -> None:
    """422 for a query parameter the route does not take (FastAPI ignores it: `/calls?opp=broadcast` answered
    every call, `/export?bin=...` exported every call) or given more than once: every parameter takes one value
    (FastAPI would keep the last silently: `?rank=0&rank=1` filtered on rank 1 alone; /compare takes its runs as
    `runs=a,b`)."""
    keys = [k for k, _ in request.query_params.multi_items()]
    route = request.scope.get("route")
    if keys and isinstance(route, APIRoute):
        key = f"{sorted(route.methods or ())} {route.path}"
        if (known := _KNOWN_QUERY.get(key)) is None:
            known = _KNOWN_QUERY[key] = frozenset(_query_names(route.dependant))
        if unknown := sorted(set(keys) - known):
            taken = ", ".join(sorted(known)) or "none"
            raise ApiError(
                422,
                f"query parameter {unknown[0]!r} is not one this route takes (it takes: {taken})",
                "invalid-request",
                errors=[{"field": f"query.{k}", "message": "not a parameter of this route"} for k in unknown],
            )
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ApiError(
            422,
            f"query parameter {twice[0]!r} is given {keys.count(twice[0])} times; each takes one value "
            "(a list, as /compare's runs, is comma-separated)",
            "invalid-request",
        )
