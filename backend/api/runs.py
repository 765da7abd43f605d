"""/api/runs: list (paginated, searchable), create, read, update, delete; the run's sources."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from commlens.contract.common import Page
from commlens.contract.runs import RunCreate, RunDetail, RunSummary, RunUpdate, SourceOut
from commlens.service import runs as service

from .aliases import FORMER_NAME
from .deps import Admin, Ctx, Cursor, Limit, Offset, Writer, next_offset
from .errors import ApiError, problem_responses

router = APIRouter(tags=["runs"])


@router.get("/runs", response_model=Page[RunSummary], summary="List runs (newest first), searchable")
def list_runs(
    cur: Cursor,
    limit: Limit = 50,
    offset: Offset = 0,
    q: Annotated[str | None, Query(max_length=200, description="substring of name, description or a tag")] = None,
    tag: Annotated[str | None, Query(max_length=64, description="runs with exactly this tag")] = None,
    strategy: Annotated[str | None, Query(max_length=128)] = None,
) -> Page[RunSummary]:
    items, total = service.list_runs(cur, limit, offset, q=q, tag=tag, strategy=strategy)
    return Page[RunSummary](
        items=[RunSummary(**i) for i in items],
        total=total,
        limit=limit,
        offset=offset,
        next_offset=next_offset(offset, limit, total),
    )


@router.get("/runs/{run}", response_model=RunDetail, responses=problem_responses(404))
def get_run(run: str, cur: Cursor) -> RunDetail:
    return RunDetail(**service.run_detail(cur, run))


@router.get(
    "/runs/{run}/sources",
    response_model=Page[SourceOut],
    responses=problem_responses(404),
    summary="The run's ingested files with their status and errors",
)
def list_sources(
    run: str,
    cur: Cursor,
    limit: Limit = 100,
    offset: Offset = 0,
    status: Annotated[str | None, Query(pattern="^(ok|failed)$")] = None,
) -> Page[SourceOut]:
    items, total = service.list_sources(cur, run, limit, offset, status)
    return Page[SourceOut](
        items=[SourceOut(**i) for i in items],
        total=total,
        limit=limit,
        offset=offset,
        next_offset=next_offset(offset, limit, total),
    )


@router.post("/runs", response_model=RunDetail, status_code=201, responses=problem_responses(401, 409, 422))
def create_run(body: RunCreate, cur: Cursor, who: Writer, response: Response) -> RunDetail:
    service.create_run(
        cur, body.name, body.description, body.tags, body.config, body.strategy, body.world_size, who.actor
    )
    response.headers["Location"] = f"/api/runs/{body.name}"
    return RunDetail(**service.run_detail(cur, body.name))


@router.patch(
    "/runs/{run}",
    response_model=RunDetail,
    responses=problem_responses(401, 403, 404, 409, 422),
    summary="Change a run; a new name is for its owner or an admin, and the old name stays an alias",
)
def update_run(run: str, body: RunUpdate, cur: Cursor, ctx: Ctx, who: Writer) -> RunDetail:
    changes = {f: getattr(body, f) for f in body.model_fields_set}
    with ctx.ingest_queue.run_lock:  # no job may be created on this run while it is renamed
        name = service.update_run(cur, run, changes, who.actor)
    return RunDetail(**service.run_detail(cur, name))


@router.delete("/runs/{run}", status_code=204, responses=problem_responses(401, 403, 404, 409))
def delete_run(run: str, request: Request, cur: Cursor, ctx: Ctx, _: Admin) -> Response:
    if (former := getattr(request.state, FORMER_NAME, None)) is not None:  # as `commlens delete` refuses it
        raise ApiError(409, f"{former!r} is a former name of run {run!r}; delete that one by its name", "former-name")
    with ctx.ingest_queue.run_lock:  # no job may start on this run while it is deleted
        service.delete_run(cur, run)
    return Response(status_code=204)
