"""All-to-all traffic between ranks: a thin adapter over commlens.service.pairs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from commlens.contract.pairs import PairsReport
from commlens.service import pairs as service

from .deps import Cursor
from .errors import problem_responses

router = APIRouter(tags=["analysis"])


@router.get(
    "/runs/{run}/pairs",
    response_model=PairsReport,
    responses=problem_responses(404, 422),
    summary="Bytes each rank's all_to_all calls sent to each receiver, per group, over the run or one step",
)
def pairs(
    run: str,
    cur: Cursor,
    group: Annotated[str | None, Query(max_length=512, description="one process group key (e.g. pg:0)")] = None,
    step: Annotated[int | None, Query(ge=-(2**31), le=2**31 - 1, description="one profiler step")] = None,
    bins: Annotated[
        int | None,
        Query(ge=1, le=4096, description="a group wider than this many ranks comes as blocks of consecutive ranks"),
    ] = None,
) -> PairsReport:
    return service.pairs(cur, run, group=group, step=step, bins=bins)
