"""Time endpoints (docs/time.md): thin adapters over commlens.service.time, which reads what the ingest
computed; nothing is analysed per request."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query

from commlens.contract.common import MAX_RANK
from commlens.contract.time import (
    MAX_MEMBER_ROWS,
    BreakdownBands,
    BreakdownReport,
    CriticalPathReport,
    Instance,
    InstancesPage,
    MismatchReport,
    StragglerReport,
    TimeSummary,
)
from commlens.service import time as service
from commlens.vocab import Op

from .deps import MAX_LIMIT, Cursor, Limit, Offset, Ranks
from .errors import problem_responses

router = APIRouter(tags=["time"])

RankQuery = Annotated[int | None, Query(ge=0, le=MAX_RANK, description="one rank")]
# A scheme, or the communication of calls without one (one Literal: an error names the field alone).
SchemeFilter = Literal["dp", "tp", "pp", "cp", "ep", "other", "unattributed"]
StepQuery = Annotated[int | None, Query(ge=-(2**31), le=2**31 - 1, description="one profiler step")]


@router.get(
    "/runs/{run}/time",
    response_model=TimeSummary,
    responses=problem_responses(404),
    summary="Where the time goes: what could be computed, clock offsets, per-rank totals and stragglers",
)
def time_summary(run: str, cur: Cursor) -> TimeSummary:
    return service.time_summary(cur, run)


@router.get(
    "/runs/{run}/time/breakdown",
    response_model=BreakdownReport,
    responses=problem_responses(404, 422),
    summary="Per rank and step: compute, overlapped, wait, exposed, memcpy, idle (µs) and per scheme; paginated",
)
def breakdown(
    run: str,
    cur: Cursor,
    rank_range: Ranks,  # first, last
    limit: Limit = MAX_LIMIT,
    offset: Offset = 0,
    rank: RankQuery = None,
    step: StepQuery = None,
    scheme: Annotated[
        SchemeFilter | None,
        Query(description="keep only this scheme's communication in each row's `schemes`"),
    ] = None,
) -> BreakdownReport:
    return service.breakdown(
        cur,
        run,
        rank=rank,
        step=step,
        scheme=scheme,
        limit=limit,
        offset=offset,
        first=rank_range.first,
        last=rank_range.last,
    )


@router.get(
    "/runs/{run}/time/breakdown/bands",
    response_model=BreakdownBands,
    responses=problem_responses(404, 422),
    summary="The breakdown of many ranks at a glance: per band of consecutive ranks, the mean step per category "
    "and the fastest and slowest step; the run's slowest steps",
)
def breakdown_bands(
    run: str,
    cur: Cursor,
    scheme: Annotated[
        SchemeFilter | None,
        Query(description="this scheme's overlapped, wait and exposed time; the rest as 'other comm'"),
    ] = None,
    band: Annotated[
        int | None,
        Query(ge=1, le=MAX_RANK + 1, description="consecutive global ranks per band (default 32, wider past 32 bands)"),
    ] = None,
) -> BreakdownBands:
    return service.breakdown_bands(cur, run, scheme=scheme, band=band)


@router.get(
    "/runs/{run}/time/instances",
    response_model=InstancesPage,
    responses=problem_responses(404, 422),
    summary="Collective instances matched across ranks: skew, waits, last arrival, real time, bandwidth; paginated",
)
def instances(
    run: str,
    cur: Cursor,
    limit: Limit = 100,
    offset: Offset = 0,
    group: Annotated[str | None, Query(max_length=512, description="a process group key, or 'world'")] = None,
    op: Annotated[Op | None, Query()] = None,
    step: StepQuery = None,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK, description="instances this rank is a member of")] = None,
    members: Annotated[bool, Query(description="send each instance's members (false: `member_count` only)")] = True,
    max_members: Annotated[
        int, Query(ge=1, le=100_000, description="member rows per page at most: the page stops before passing it")
    ] = MAX_MEMBER_ROWS,
) -> InstancesPage:
    return service.instances(
        cur,
        run,
        group=group,
        op=op,
        step=step,
        rank=rank,
        limit=limit,
        offset=offset,
        members=members,
        max_members=max_members,
    )


@router.get(
    "/runs/{run}/time/instances/{instance_id}",
    response_model=Instance,
    responses=problem_responses(404, 422),
    summary="One collective instance with all its members",
)
def instance(run: str, instance_id: Annotated[int, Path(ge=0, le=2**31 - 1)], cur: Cursor) -> Instance:
    return service.instance(cur, run, instance_id)


@router.get(
    "/runs/{run}/time/stragglers",
    response_model=StragglerReport,
    responses=problem_responses(404),
    summary="Per group: the straggler named with its evidence, or why none is; arrivals per rank",
)
def stragglers(run: str, cur: Cursor) -> StragglerReport:
    return service.stragglers(cur, run)


@router.get(
    "/runs/{run}/time/critical-path",
    response_model=CriticalPathReport,
    responses=problem_responses(404, 422),
    summary="Each step's critical path across ranks, with the exposed communication on it per scheme",
)
def critical_path(
    run: str,
    cur: Cursor,
    step: StepQuery = None,
    segments: Annotated[bool, Query(description="send each path's segments (false: `segment_count` only)")] = True,
) -> CriticalPathReport:
    return service.critical_paths(cur, run, step=step, with_segments=segments)


@router.get(
    "/runs/{run}/time/mismatches",
    response_model=MismatchReport,
    responses=problem_responses(404),
    summary="Calls that could not be matched across their group, with both sides",
)
def mismatches(run: str, cur: Cursor) -> MismatchReport:
    return service.mismatches(cur, run)
