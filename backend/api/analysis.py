"""Analysis endpoints: thin wrappers over commlens.backend functions (no analysis logic here)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Literal, get_args

from fastapi import APIRouter, Path, Query, Response

from commlens.backend import attribution
from commlens.backend.bandwidth import bandwidth
from commlens.backend.compare import compare
from commlens.backend.findings import findings
from commlens.backend.histograms import bar_calls, histogram
from commlens.backend.iterations import UnknownRunError, assign_iterations
from commlens.backend.predict import predict
from commlens.backend.ranks import rank_summary, rank_totals
from commlens.backend.run_cache import cached_findings
from commlens.contract.analysis import (
    BandwidthReport,
    BarCalls,
    Finding,
    GroupAttribution,
    GroupOverride,
    GroupsPage,
    Histogram,
    IterationInfo,
    RankBasis,
    RankMetric,
    RankSummary,
    RankTotals,
    TopologyRows,
)
from commlens.contract.common import MAX_RANK, Page
from commlens.contract.compare import Comparison, RunComparison, RunsComparison
from commlens.contract.predict import PredictInput, Prediction
from commlens.contract.review import Anchor, ReviewItem
from commlens.service.nccl import nccl_rows
from commlens.service.runs import predict_input_for_run, resolve_alias, run_layout
from commlens.service.schemes import clear_scheme_override, override_scheme
from commlens.vocab import Op, evidence_key

from .deps import Cursor, Limit, Offset, Ranks, Writer, next_offset
from .errors import ApiError, problem_responses
from .review import create_item

router = APIRouter(tags=["analysis"])
Scheme = Literal["dp", "tp", "pp", "cp", "ep", "other"]


@contextmanager
def analysis_errors() -> Iterator[None]:
    """Analysis functions say ValueError for bad arguments and LookupError for missing things."""
    try:
        yield
    except UnknownRunError:
        raise
    except LookupError as exc:
        # a KeyError's str() is its message quoted; stripping quotes off any other message cut a closing quote
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) else str(exc)
        raise ApiError(404, message, "not-found") from None
    except ValueError as exc:
        raise ApiError(422, str(exc), "invalid-argument") from None


# ---------------------------------------------------------------------------------- attribution


@router.get(
    "/runs/{run}/groups",
    response_model=GroupsPage,
    responses=problem_responses(404),
    summary="Process groups / communicators with their scheme and the reason for it, paginated",
)
def groups(run: str, cur: Cursor, limit: Limit = 100, offset: Offset = 0) -> GroupsPage:
    with analysis_errors():
        s = attribution.attribution_summary(cur, run)
    total = len(s.groups)
    return GroupsPage(
        run=s.run,
        items=s.groups[offset : offset + limit],
        total=total,
        limit=limit,
        offset=offset,
        next_offset=next_offset(offset, limit, total),
        unattributed_events=s.unattributed_events,
        events_by_scheme=s.events_by_scheme,
    )


@router.patch(
    "/runs/{run}/groups/{group_key:path}",
    response_model=GroupAttribution,
    responses=problem_responses(401, 404, 409, 422),
    summary="Pin a group's scheme (stored override); scheme null drops the override",
)
def override_group(run: str, group_key: str, body: GroupOverride, cur: Cursor, _: Writer) -> GroupAttribution:
    with analysis_errors():
        if body.scheme is None:
            if body.reason:  # it would be dropped without a word: a reason is stored with an override only
                raise ApiError(
                    422,
                    "scheme null drops the override, which keeps no reason; leave the reason out",
                    "invalid-argument",
                    errors=[{"field": "reason", "message": "not taken with scheme null"}],
                )
            result = clear_scheme_override(cur, run, group_key)
            hit = [g for g in result if g.group_key == group_key]
            if not hit:
                raise ApiError(404, f"run {run!r} has no process group {group_key!r}", "unknown-group")
            return hit[0]
        scheme, reason = body.scheme, body.reason
        if not reason:
            raise ApiError(
                422,
                "an override needs a reason: what you know that the traces do not say",
                "invalid-argument",
                errors=[{"field": "reason", "message": "required with a scheme"}],
            )
        return override_scheme(cur, run, group_key, scheme, reason)


# -------------------------------------------------------------------------------- distributions


@router.get(
    "/runs/{run}/histograms",
    response_model=Histogram,
    responses=problem_responses(404, 422),
    summary="Message-size histogram per scheme x op x dtype (power-of-two bins)",
)
def histograms(
    run: str,
    cur: Cursor,
    scheme: Annotated[
        Scheme | Literal["unattributed"] | None, Query(description="'unattributed': calls without a scheme")
    ] = None,
    op: Annotated[Op | None, Query()] = None,
    dtype: Annotated[str | None, Query(max_length=32)] = None,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK)] = None,
    step: Annotated[
        int | None, Query(ge=-(2**31), le=2**31 - 1, description="profiler step, or detected iteration")
    ] = None,
    weight: Annotated[Literal["calls", "bytes"], Query()] = "calls",
    normalize: Annotated[bool, Query(description="per rank per iteration when iterations are known")] = True,
) -> Histogram:
    with analysis_errors():
        return histogram(
            cur, run, scheme=scheme, op=op, dtype=dtype, rank=rank, step=step, weight=weight, normalize=normalize
        )


@router.get(
    "/runs/{run}/calls",
    response_model=BarCalls,
    responses=problem_responses(404, 422),
    summary="The calls of a histogram bar (same filters as /histograms plus the bin), paginated",
)
def calls(
    run: str,
    cur: Cursor,
    limit: Limit = 100,
    offset: Offset = 0,
    bin: Annotated[
        str | None,
        Query(
            max_length=16,
            pattern=r"^(zero|unknown|2\^\d{1,2})$",
            description="the bar's bin key ('zero', 'unknown', '2^k'); absent: every size",
        ),
    ] = None,
    scheme: Annotated[
        Scheme | Literal["unattributed"] | None, Query(description="'unattributed': calls without a scheme")
    ] = None,
    op: Annotated[Op | None, Query()] = None,
    dtype: Annotated[str | None, Query(max_length=32, description="'unknown': calls without a dtype")] = None,
    rank: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    step: Annotated[
        int | None, Query(ge=-(2**31), le=2**31 - 1, description="profiler step, or detected iteration")
    ] = None,
    normalize: Annotated[
        bool, Query(description="as the histogram: only calls inside complete iterations when iterations are known")
    ] = True,
) -> BarCalls:
    with analysis_errors():
        return bar_calls(
            cur,
            run,
            bin=bin,
            scheme=scheme,
            op=op,
            dtype=dtype,
            rank=rank,
            step=step,
            normalize=normalize,
            limit=limit,
            offset=offset,
        )


@router.get("/runs/{run}/iterations", response_model=IterationInfo, responses=problem_responses(404))
def iterations(run: str, cur: Cursor) -> IterationInfo:
    with analysis_errors():
        return assign_iterations(cur, run).info


@router.get("/runs/{run}/bandwidth", response_model=BandwidthReport, responses=problem_responses(404))
def run_bandwidth(run: str, cur: Cursor) -> BandwidthReport:
    with analysis_errors():
        return bandwidth(cur, run)


@router.get(
    "/runs/{run}/ranks",
    response_model=RankTotals,
    responses=problem_responses(404, 422),
    summary="Per-rank totals per scheme and the imbalance between ranks",
)
def ranks(
    run: str,
    cur: Cursor,
    rank_range: Ranks,
) -> RankTotals:
    with analysis_errors():
        return rank_totals(cur, run, rank_range.first, rank_range.last)


@router.get(
    "/runs/{run}/ranks/summary",
    response_model=RankSummary,
    responses=problem_responses(404),
    summary="Per-rank values summarised for many ranks: spread and outliers per scheme, bands of ranks or hosts",
)
def ranks_summary(
    run: str,
    cur: Cursor,
    metric: RankMetric = "bytes",
    basis: RankBasis = "per_iteration",
    band: Annotated[int, Query(ge=1, le=4096, description="consecutive global ranks per band")] = 32,
) -> RankSummary:
    with analysis_errors():
        return rank_summary(cur, run, metric, basis, band)


@router.get(
    "/runs/{run}/report",
    responses={**problem_responses(404), 200: {"content": {"application/json": {}, "text/markdown": {}}}},
    summary="The run's report as `commlens report` prints it (read through the server while it holds the store)",
)
def run_report(run: str, cur: Cursor, format: Literal["json", "md"] = "json") -> Response:
    from commlens.backend.iterations import run_id_of
    from commlens.backend.report import build_report, render_markdown
    from commlens.service.time import time_summary

    run_id_of(cur, run)  # 404 for an unknown run
    with analysis_errors():
        rep = build_report(cur, run, None, time_summary(cur, run))
    if format == "md":
        return Response(render_markdown(rep), media_type="text/markdown; charset=utf-8")
    return Response(rep.model_dump_json(indent=2) + "\n", media_type="application/json")


# ------------------------------------------------------------------------------------- findings


def _findings(cur: Cursor, run: str) -> list[Finding]:
    """Findings, with the predicted-vs-measured checks when the run has a configuration (as `commlens report`);
    kept per version of the run (backend/run_cache.py)."""

    def compute() -> list[Finding]:
        comparison = run_compare(cur, run) if run_predict_input(cur, run) is not None else None
        with analysis_errors():
            return findings(cur, run, comparison.findings_input() if comparison is not None else None)

    return cached_findings(cur, run, compute)


@router.get(
    "/runs/{run}/findings",
    response_model=Page[Finding],
    responses=problem_responses(404),
    summary="Findings, most severe and most impactful first",
)
def run_findings(run: str, cur: Cursor, limit: Limit = 50, offset: Offset = 0) -> Page[Finding]:
    found = _findings(cur, run)
    return Page[Finding](
        items=found[offset : offset + limit],
        total=len(found),
        limit=limit,
        offset=offset,
        next_offset=next_offset(offset, limit, len(found)),
    )


@router.post(
    "/runs/{run}/findings/{finding_id:path}/review",
    response_model=ReviewItem,
    status_code=201,
    responses=problem_responses(401, 404, 409),
    summary="Promote a finding to a review item",
)
def promote_finding(run: str, finding_id: str, cur: Cursor, who: Writer) -> ReviewItem:
    found = {f.id: f for f in _findings(cur, run)}
    f = found.get(finding_id)
    if f is None:
        raise ApiError(
            404,
            f"run {run!r} has no finding {finding_id!r} now; GET /api/runs/{run}/findings lists them",
            "unknown-finding",
        )
    evidence = "\n".join(  # as the finding card shows it (97%, 16.0 ms, 507 KiB); what it does not know is left out
        f"| {(evidence_key(k) if k in f.evidence_text else k).replace('_', ' ')} | {f.evidence_text.get(k, v)} |"
        for k, v in f.evidence.items()
        if v is not None
    )
    body = f"**{f.title}** ({f.severity})\n\n| evidence | value |\n|---|---|\n{evidence}\n\nSuggestion: {f.suggestion}"

    view = f.view
    anchor = Anchor.model_validate(
        {
            "view": str(view.get("page")) if view.get("page") else None,
            "scheme": view.get("scheme") if view.get("scheme") in get_args(Scheme) else None,
            "op": view.get("op") if view.get("op") in get_args(Op) else None,
            "rank": view.get("rank") if isinstance(view.get("rank"), int) else None,
            "free": "; ".join(f"{k}={v}" for k, v in view.items() if k not in ("page", "scheme", "op", "rank"))[:500]
            or None,
        }
    )
    return create_item(cur, run, who, body, anchor, finding=finding_id)


# ---------------------------------------------------------------------------------- predictions


# The predictor's time and answer grow with layers and stages; a request is a request, not a batch job.
MAX_PREDICT_LAYERS = 4096
MAX_PREDICT_STAGES = 512
MAX_PREDICT_WORLD = 1 << 20  # the answer lists every stage's ranks: 1 M ranks are about 8 MB of JSON


def check_predict_size(inp: PredictInput) -> None:
    p = inp.parallel
    if inp.model.layers > MAX_PREDICT_LAYERS:
        raise ApiError(
            422,
            f"model.layers = {inp.model.layers}; the API predicts models of at most "
            f"{MAX_PREDICT_LAYERS} layers (use backend.predict.predict directly for more)",
            "prediction-too-large",
        )
    if p.world_size > MAX_PREDICT_WORLD:
        raise ApiError(
            422,
            f"world size {p.world_size:,} (dp*tp*pp*cp*ep); the API predicts jobs of at most {MAX_PREDICT_WORLD:,} "
            "ranks (use backend.predict.predict directly for more)",
            "prediction-too-large",
        )
    if p.pp * p.virtual_stages > MAX_PREDICT_STAGES:
        raise ApiError(
            422,
            f"pp x virtual_stages = {p.pp * p.virtual_stages}; the API lists at most {MAX_PREDICT_STAGES} "
            "pipeline stages per prediction",
            "prediction-too-large",
        )


def run_predict_input(cur: Cursor, run: str) -> PredictInput | None:
    """The predictor input of the run's stored config (a harness run.json or a PredictInput), if any."""
    return predict_input_for_run(cur, run)


def run_compare(cur: Cursor, run: str, supplied: PredictInput | None = None) -> Comparison:
    """compare() with the run's own config (a harness run.json or a predictor input, which compare reads
    itself) or the supplied one; an unusable stored config is a 422 here, before any work."""
    for c in (supplied, predict_input_for_run(cur, run)):
        if c is not None:
            check_predict_size(c)
    with analysis_errors():
        return compare(cur, run, supplied)


@router.get(
    "/runs/{run}/prediction",
    response_model=Prediction,
    responses=problem_responses(404, 409, 422),
    summary="The analytical prediction for the run's own configuration",
)
def run_prediction(run: str, cur: Cursor) -> Prediction:
    config = run_predict_input(cur, run)
    if config is None:
        raise ApiError(
            409,
            f"run {run!r} has no configuration to predict from; PATCH /api/runs/{run} with a config "
            "(a harness run.json or a predictor input), or use POST /api/predict",
            "no-config",
        )
    check_predict_size(config)
    with analysis_errors():
        return predict(config)


@router.get(
    "/runs/{run}/comparison",
    response_model=Comparison,
    responses=problem_responses(404, 422),
    summary="Predicted (from the run's config) against measured, per scheme and per (op, dtype, size)",
)
def run_comparison(run: str, cur: Cursor) -> Comparison:
    return run_compare(cur, run)


@router.post(
    "/runs/{run}/comparison",
    response_model=Comparison,
    responses=problem_responses(404, 422),
    summary="What-if: a supplied configuration's prediction against the run's measurements",
)
def run_comparison_with(run: str, body: PredictInput, cur: Cursor) -> Comparison:
    return run_compare(cur, run, body)


MAX_COMPARE_RUNS = 8


@router.get(
    "/compare",
    response_model=RunsComparison,
    responses=problem_responses(404, 422),
    summary="Several runs side by side: each run's predicted-vs-measured comparison",
)
def compare_runs(
    cur: Cursor,
    runs: Annotated[str, Query(max_length=2000, description="comma-separated run names, 1 to 8")],
) -> RunsComparison:
    given = [r.strip() for r in runs.split(",") if r.strip()]
    if not 1 <= len(given) <= MAX_COMPARE_RUNS:
        raise ApiError(
            422, f"runs must name 1 to {MAX_COMPARE_RUNS} different runs, comma-separated", "invalid-argument"
        )
    # a link from before a rename holds former names: a run is the same under its old and its new name
    names = [resolve_alias(cur, n) or n for n in given]
    if len(set(names)) != len(names):
        renamed = "".join(
            f"; {g!r} is a former name of {n!r}" for g, n in dict(zip(given, names, strict=True)).items() if g != n
        )
        raise ApiError(
            422,
            f"runs must name 1 to {MAX_COMPARE_RUNS} different runs, comma-separated{renamed}",
            "invalid-argument",
        )
    out = []
    for name in names:
        comparison = run_compare(cur, name)
        strategy, world_size = run_layout(cur, name)
        out.append(RunComparison(run=name, strategy=strategy, world_size=world_size, comparison=comparison))
    return RunsComparison(runs=out)


@router.post(
    "/predict",
    response_model=Prediction,
    responses=problem_responses(422),
    summary="Predict the communication of any configuration (what-if)",
)
def what_if(body: PredictInput) -> Prediction:
    check_predict_size(body)
    with analysis_errors():
        return predict(body)


# ------------------------------------------------------------------------------------- topology


@router.get(
    "/runs/{run}/topology/{table}",
    response_model=TopologyRows,
    responses=problem_responses(404),
    summary="NCCL rows of the run: communicators (comms), rings/trees/connections (topology), tuning",
)
def topology(
    run: str,
    cur: Cursor,
    table: Annotated[Literal["comms", "topology", "tuning"], Path()],
    limit: Limit = 500,
    offset: Offset = 0,
    group_key: Annotated[str | None, Query(max_length=256)] = None,
) -> TopologyRows:
    columns, rows, total = nccl_rows(cur, run, table, limit, offset, group_key)
    return TopologyRows(
        table=table,
        columns=columns,
        rows=rows,
        total=total,
        limit=limit,
        offset=offset,
        next_offset=next_offset(offset, limit, total),
    )
