"""Hang and per-rank sources endpoints: thin adapters over commlens.service.hang."""

from __future__ import annotations

from fastapi import APIRouter

from commlens.contract.hang import HangReport, RankSourcesReport
from commlens.service import hang as service

from .deps import Cursor
from .errors import problem_responses

router = APIRouter(tags=["hang"])


@router.get(
    "/runs/{run}/hang",
    response_model=HangReport,
    responses=problem_responses(404),
    summary="Groups whose latest collective did not complete: arrived and missing ranks (Flight Recorder)",
)
def hang(run: str, cur: Cursor) -> HangReport:
    return service.hang_report(cur, run)


@router.get(
    "/runs/{run}/rank-sources",
    response_model=RankSourcesReport,
    responses=problem_responses(404),
    summary="Per rank, the files that describe it and how many of their calls count",
)
def rank_sources(run: str, cur: Cursor) -> RankSourcesReport:
    return service.rank_sources(cur, run)
