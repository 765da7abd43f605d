"""Findings: what in a run's communication deserves attention, ranked by severity then impact, each
with its evidence, the view that shows it, and a concrete suggestion.

Checks: latency-bound small messages per scheme (the study's headline), rank imbalance in bytes or
time, busbw far below the run's own best, ZeRO-2/3 traffic multiplied by gradient accumulation (the
run's config, or one supplied), and, given a comparison with the prediction, volume above prediction
and unexplained calls.
Each check has a threshold below which it stays silent; the thresholds are module constants.
Every check reads the run's aggregates (commlens.ingest.aggregates), never the calls themselves.
"""

from __future__ import annotations

import json
from typing import Any

import duckdb
import pyarrow as pa
from pydantic import BaseModel

from commlens.contract.analysis import SEVERITY_ORDER, BandwidthReport, ComparisonInput, Finding, RankTotals
from commlens.store.aggregates import measured_kind_sql, registered
from commlens.vocab import format_bytes

from .bandwidth import bandwidth
from .iterations import fresh_run_id
from .ranks import rank_totals

# Size below which a call counts as small when the run has no measured bandwidth curve for its op.
DEFAULT_SMALL_BYTES = 64 * 1024
# Ceiling on a measured half-bandwidth size. In the alpha-beta model busbw reaches half its peak at
# S = alpha x B, about 0.5-1.5 MB for NVLink or InfiniBand; a measured point far above that comes from
# kernel times stretched by overlap with compute or by waiting for a late peer, not from latency.
SMALL_BYTES_CAP = 1 << 20
SMALL_CALL_SHARE = 0.25  # fire when small calls are at least this share of a scheme's calls ...
SMALL_TIME_SHARE = 0.10  # ... or of its measured time
IMBALANCE_RATIO = 1.10  # max/mean above which ranks are uneven
LOW_BUSBW_RATIO = 0.5  # large-message busbw below this share of the run's best
MIN_LARGE_CALLS = 3

_SUGGEST_SMALL = {
    "pp": "Batch the sends and receives of one schedule step into one group (batch_isend_irecv), send each "
    "micro-batch's activations as one contiguous tensor instead of one call per tensor, and drop per-step "
    "shape/metadata sends by fixing tensor shapes; fewer, larger micro-batches also raise the message size.",
    "dp": "Raise the gradient bucket size (DDP bucket_cap_mb, DeepSpeed reduce_bucket_size) so small gradients "
    "travel together, and fuse scalar reductions (loss, grad norm, overflow check) into one all_reduce.",
    "tp": "Fuse the small tensor-parallel collectives (for example the cross-entropy statistics) into one call, "
    "or give each call more tokens (larger micro-batch or sequence per call).",
    "cp": "Exchange larger KV blocks per step (fewer, larger ring steps) or overlap the exchanges with attention "
    "compute so their latency hides.",
    "ep": "Coalesce token dispatch per layer (one all_to_all for all experts of a rank) and raise the tokens per "
    "call; small all_to_alls are latency-bound on every link.",
}


def _severity(value: float, high: float, medium: float, low: float, higher_is_worse: bool = True) -> str | None:
    if not higher_is_worse:
        value, high, medium, low = -value, -high, -medium, -low
    if value >= high:
        return "high"
    if value >= medium:
        return "medium"
    if value >= low:
        return "low"
    return None


def _config(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, Any]:
    row = con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchall()[0]
    if not row or row[0] is None:
        return {}
    value = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------- small messages


def _small_messages(con: duckdb.DuckDBPyConnection, run_id: int, bw: BandwidthReport) -> list[Finding]:
    thresholds = {o.op: min(o.half_bw_bytes, SMALL_BYTES_CAP) for o in bw.ops if o.half_bw_bytes}
    ops = [r[0] for r in con.execute("SELECT DISTINCT op FROM comm_agg WHERE run_id = ?", [run_id]).fetchall()]
    table = pa.table(
        {
            "op": pa.array(ops, pa.string()),
            "threshold": pa.array([thresholds.get(op, DEFAULT_SMALL_BYTES) for op in ops], pa.int64()),
            "measured": pa.array([op in thresholds for op in ops], pa.bool_()),
        }
    )
    measured = measured_kind_sql("a", "g")
    with registered(con, table) as tname:
        # From the run's aggregates: one row per (group, op, size, duration kind, ...), weighted by calls.
        rows = con.execute(
            f"""
            WITH c AS (
                SELECT g.scheme, a.op, a.msg_bytes, a.calls, a.first_row, t.threshold, t.measured,
                       a.msg_bytes < t.threshold AS small,
                       CASE WHEN {measured} THEN a.sum_dur_us END AS dur,
                       CASE WHEN {measured} THEN a.calls ELSE 0 END AS timed
                FROM comm_agg a
                LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
                JOIN {tname} t ON t.op = a.op
                WHERE a.run_id = ? AND a.msg_bytes IS NOT NULL AND a.op <> 'barrier'
            ), small_ops AS (
                -- the most common small op per scheme (ties: the one seen first, as mode() does)
                SELECT scheme, first(op ORDER BY n DESC, first_seen) AS top_op FROM (
                    SELECT scheme, op, sum(calls) AS n, min(first_row) AS first_seen
                    FROM c WHERE small GROUP BY scheme, op
                ) GROUP BY scheme
            )
            SELECT c.scheme, sum(c.calls), coalesce(sum(c.calls) FILTER (WHERE c.small), 0), sum(c.dur),
                   sum(c.dur) FILTER (WHERE c.small), sum(c.timed), any_value(s.top_op),
                   bool_and(c.measured) FILTER (WHERE c.small), max(c.threshold) FILTER (WHERE c.small),
                   coalesce(sum(cast(c.msg_bytes AS HUGEINT) * c.calls) FILTER (WHERE c.small), 0)
            FROM c LEFT JOIN small_ops s ON s.scheme IS NOT DISTINCT FROM c.scheme
            GROUP BY c.scheme
            """,
            [run_id],
        ).fetchall()
    run_calls = sum(r[1] for r in rows)
    run_time = sum(r[3] or 0.0 for r in rows)
    out = []
    for scheme, calls, small, time, small_time, timed, top_op, all_measured, threshold, small_bytes in rows:
        if not small:
            continue
        call_share = small / calls
        has_time = timed >= 0.9 * calls and time  # (nearly) every call timed: time shares mean something
        time_share = (small_time or 0.0) / time if has_time else None
        if call_share < SMALL_CALL_SHARE and (time_share is None or time_share < SMALL_TIME_SHARE):
            continue
        if time_share is not None:
            if time_share >= 0.3:
                severity = "high"
            else:
                severity = "medium" if time_share >= SMALL_TIME_SHARE or call_share >= 0.5 else "low"
            impact = (small_time or 0.0) / run_time if run_time else 0.0
        else:
            severity = "medium" if call_share >= 0.5 else "low"
            impact = small / run_calls
        name = scheme or "unattributed"
        limit = (
            f"below the size where busbw reaches half its best (measured per op in this run, at most "
            f"{format_bytes(SMALL_BYTES_CAP)})"
            if all_measured
            else f"below {format_bytes(DEFAULT_SMALL_BYTES)} (default; no measured bandwidth curve for these ops)"
        )
        title = (
            f"{name}: {call_share:.0%} of calls"
            + (f" and {time_share:.0%} of communication time" if time_share is not None else "")
            + " are small, latency-bound messages"
        )
        out.append(
            Finding(
                id=f"small-messages:{name}",
                title=title,
                severity=severity,
                impact=impact,  # type: ignore[arg-type]
                evidence={
                    "scheme": scheme,
                    "calls": calls,
                    "small_calls": small,
                    "small_call_share": call_share,
                    "small_time_share": time_share,
                    "small_time_us": small_time if time_share is not None else None,
                    "small_bytes": int(small_bytes),
                    "most_common_small_op": top_op,
                    "threshold": limit,
                    "threshold_bytes": int(threshold) if threshold else None,
                },
                view={"page": "histograms", "scheme": scheme, "op": top_op},
                suggestion=_SUGGEST_SMALL.get(
                    scheme or "",
                    "Find the call sites of these small calls (group and op in "
                    "the histogram) and coalesce them; below the half-bandwidth size each call "
                    "pays mostly latency.",
                ),
            )
        )
    return out


# ----------------------------------------------------------------------------------- ranks


def _pp_chain_ratio(con: duckdb.DuckDBPyConnection, run_id: int) -> float:
    """Expected max/mean of per-rank pp bytes for a pipeline chain: the end stages talk to one
    neighbour, interior stages to two, so p stages give p / (p - 1)."""
    sql = "SELECT max(size) FROM process_groups WHERE run_id = ? AND scheme = 'pp'"
    p = con.execute(sql, [run_id]).fetchall()[0][0]
    return p / (p - 1) if p and p > 2 else 1.0


def _imbalance(con: duckdb.DuckDBPyConnection, run_id: int, totals: RankTotals) -> list[Finding]:
    run_bytes = sum(r.bytes for r in totals.rows) or 1
    run_time = sum(r.time_us or 0.0 for r in totals.rows) or None
    out: list[Finding] = []
    fired: set[str] = set()
    schemes = {r.scheme for r in totals.rows}
    chain = _pp_chain_ratio(con, run_id) if "pp" in schemes else 1.0
    for imb in sorted(totals.imbalance, key=lambda i: i.all_schemes):  # per scheme first, then overall
        # The overall view only adds something when several schemes mix and none was uneven alone.
        if imb.all_schemes and (imb.metric in fired or len(schemes) < 2):
            continue
        expected = chain if (imb.scheme == "pp" or imb.all_schemes) and imb.metric == "bytes" else 1.0
        ratio = imb.max_over_mean / expected
        severity = _severity(ratio, 1.5, 1.25, IMBALANCE_RATIO)
        if severity is None:
            continue
        fired.add(imb.metric)
        rows = [r for r in totals.rows if imb.all_schemes or r.scheme == imb.scheme]
        if imb.metric == "bytes":
            impact = sum(r.bytes for r in rows) / run_bytes
        else:
            impact = sum(r.time_us or 0.0 for r in rows) / run_time if run_time else 0.0
        name = "all schemes" if imb.all_schemes else imb.scheme or "unattributed"
        what = "bytes" if imb.metric == "bytes" else "communication time"
        if imb.metric == "bytes":
            suggestion = (
                f"Rank {imb.max_rank} moves {imb.max_over_mean:.2f}x the mean {what} in {name}. Check uneven "
                "sharding or bucket assignment, pipeline stages with unequal layer counts, or skewed expert "
                "routing; balance the work so no rank carries more traffic than its peers."
            )
        else:
            suggestion = (
                f"Rank {imb.max_rank} spends {imb.max_over_mean:.2f}x the mean {what} in {name}. Time "
                "in a collective includes waiting for the slowest peer: look for a straggler (compute "
                "imbalance, data loading) or a slower link for that rank on the topology page."
            )
        title = f"{name}: uneven {what} across ranks (max/mean {imb.max_over_mean:.2f}, rank {imb.max_rank})"
        out.append(
            Finding(
                id=f"imbalance:{name}:{imb.metric}",
                title=title,
                severity=severity,
                impact=impact,  # type: ignore[arg-type]
                evidence={
                    "scheme": name,
                    "metric": imb.metric,
                    "basis": imb.basis,
                    "ranks": imb.ranks,
                    "max": imb.max,
                    "mean": imb.mean,
                    "max_over_mean": imb.max_over_mean,
                    "expected_max_over_mean": expected,
                    "max_rank": imb.max_rank,
                    "min_rank": imb.min_rank,
                },
                view={
                    "page": "ranks",
                    "scheme": None if imb.all_schemes else imb.scheme,
                    "metric": imb.metric,
                    "rank": imb.max_rank,
                },
                suggestion=suggestion,
            )
        )
    return out


# ------------------------------------------------------------------------------- bandwidth


def _low_busbw(bw: BandwidthReport) -> list[Finding]:
    best = bw.best_busbw_gbps
    if not best:
        return []
    total_time = sum(s.time_us for s in bw.by_scheme) or 1.0
    out = []
    for s in bw.by_scheme:
        if s.large_calls < MIN_LARGE_CALLS or s.large_median_busbw_gbps is None:
            continue
        ratio = s.large_median_busbw_gbps / best
        severity = "high" if ratio < 0.25 else "medium" if ratio < LOW_BUSBW_RATIO else None
        if severity is None:
            continue
        name = s.scheme or "unattributed"
        out.append(
            Finding(
                id=f"low-busbw:{name}:{s.op}",
                title=f"{name} {s.op}: bandwidth-bound calls reach {ratio:.0%} of the run's best busbw",
                severity=severity,
                impact=s.time_us / total_time,  # type: ignore[arg-type]
                evidence={
                    "scheme": s.scheme,
                    "op": s.op,
                    "large_calls": s.large_calls,
                    "median_busbw_gbps": s.large_median_busbw_gbps,
                    "run_best_busbw_gbps": best,
                    "ratio": ratio,
                    "time_us": s.time_us,
                },
                view={"page": "bandwidth", "scheme": s.scheme, "op": s.op},
                suggestion="Compare this group's links with the best one (topology page): a group spanning nodes runs "
                "at network speed, so place this dimension inside a node if the mesh allows; otherwise check "
                "NCCL's algorithm/protocol choice and channel count for these sizes, and contention with "
                "overlapping collectives of other groups.",
            )
        )
    return out


# ------------------------------------------------------------------------------ run config


def _zero_accumulation(config: dict[str, Any], totals: RankTotals) -> list[Finding]:
    parallel = config.get("parallel") or {}
    zero, m = int(parallel.get("zero") or 0), int(parallel.get("micro_batches") or 1)
    if zero < 2 or m < 2:
        return []
    # docs/models.md §6.2 with w_param = w_grad: ZeRO-2 moves m*G + P where ZeRO-1 moves G + P;
    # ZeRO-3 moves m*(2P + G) where stage 0 moves 2G (ring wire bytes): ratios (m + 1) / 2 and 3m / 2.
    ratio, baseline = ((m + 1) / 2, "ZeRO-1") if zero == 2 else (3 * m / 2, "DDP (stage 0)")
    severity = _severity(ratio, 4.0, 2.0, 1.0)
    dp_bytes = sum(r.bytes for r in totals.rows if r.scheme == "dp")
    all_bytes = sum(r.bytes for r in totals.rows)
    dp_share = dp_bytes / all_bytes if all_bytes else 1.0
    per_it = [r.bytes_per_iteration for r in totals.rows if r.scheme == "dp" and r.bytes_per_iteration is not None]
    return [
        Finding(
            id="zero-accumulation",
            severity=severity or "low",
            impact=(1 - 1 / ratio) * dp_share,  # type: ignore[arg-type]
            title=f"ZeRO-{zero} with {m} accumulation micro-steps: about {ratio:.1f}x the data-parallel traffic "
            f"of {baseline}",
            evidence={
                "zero_stage": zero,
                "micro_batches": m,
                "predicted_ratio": ratio,
                "baseline": baseline,
                "dp_degree": parallel.get("dp"),
                "measured_dp_bytes_per_rank_per_iteration": sum(per_it) / len(per_it) if per_it else None,
            },
            view={"page": "predicted", "scheme": "dp"},
            suggestion=(
                f"ZeRO-{zero} reduces (and for stage 3 gathers) every micro-step, so traffic grows with the "
                f"{m} accumulation steps. Use fewer, larger micro-batches if memory allows, or ZeRO-1 (gradients "
                "stay whole during accumulation and are reduced once per step) when the optimizer-state saving "
                "is enough."
            ),
        )
    ]


# ----------------------------------------------------------------------------- comparison


def _comparison(comparison: ComparisonInput) -> list[Finding]:
    total = sum(s.measured_bytes for s in comparison.per_scheme) or 1.0
    out = []
    for s in comparison.per_scheme:
        excess = (
            (s.measured_bytes - s.predicted_bytes) / s.predicted_bytes
            if s.predicted_bytes
            else (float("inf") if s.measured_bytes > 0 else 0.0)
        )
        if excess > comparison.tolerance:
            severity = _severity(excess, 0.5, 0.2, comparison.tolerance)
            out.append(
                Finding(
                    id=f"above-prediction:{s.scheme}",
                    severity=severity or "low",  # type: ignore[arg-type]
                    impact=(s.measured_bytes - s.predicted_bytes) / total,
                    title=(
                        f"{s.scheme}: measured volume {excess:.0%} above the prediction"
                        if s.predicted_bytes
                        else f"{s.scheme}: traffic measured where none was predicted"
                    ),
                    evidence={
                        "scheme": s.scheme,
                        "predicted_bytes": s.predicted_bytes,
                        "measured_bytes": s.measured_bytes,
                        "excess": excess if s.predicted_bytes else None,
                        "tolerance": comparison.tolerance,
                        "basis": comparison.basis,
                    },
                    view={"page": "predicted", "scheme": s.scheme},
                    suggestion="Open the per (op, size) comparison for this scheme: extra calls of one size point at a "
                    "framework detail the model lacks (bucket layout, per-micro-step reductions, reduce "
                    "instead of reduce_scatter, repeated parameter gathers); fix the configuration or tell "
                    "the predictor about it.",
                )
            )
        if s.unexplained_calls > 0:
            share = s.unexplained_bytes / s.measured_bytes if s.measured_bytes else 0.0
            out.append(
                Finding(
                    id=f"unexplained-calls:{s.scheme}",
                    severity="medium" if share >= 0.05 else "low",
                    impact=s.unexplained_bytes / total,
                    title=f"{s.scheme}: {s.unexplained_calls} calls the model does not explain",
                    evidence={
                        "scheme": s.scheme,
                        "unexplained_calls": s.unexplained_calls,
                        "unexplained_bytes": s.unexplained_bytes,
                        "share_of_measured_bytes": share,
                        "basis": comparison.basis,
                    },
                    view={"page": "predicted", "scheme": s.scheme, "filter": "unexplained"},
                    suggestion="List these calls by op and size: metadata sends, scalar all_reduces and setup broadcasts "
                    "are expected extras; anything large is traffic the configuration did not intend.",
                )
            )
    return out


def findings(
    con: duckdb.DuckDBPyConnection, run: str, comparison: Any = None, config: BaseModel | dict[str, Any] | None = None
) -> list[Finding]:
    """All findings of a run, most severe and most impactful first. `comparison` is a ComparisonInput
    or any object/dict with per_scheme entries (scheme, predicted_bytes, measured_bytes,
    unexplained_calls). `config` (a PredictInput, run.json or dict with a `parallel` section) replaces
    the run's stored config, as a config supplied to `commlens report --config` does."""
    run_id = fresh_run_id(con, run)
    bw = bandwidth(con, run)
    totals = rank_totals(con, run)
    out = _small_messages(con, run_id, bw) + _imbalance(con, run_id, totals) + _low_busbw(bw)
    if config is None:
        config = _config(con, run_id)
    elif isinstance(config, BaseModel):
        config = config.model_dump(mode="json")
    out += _zero_accumulation(config, totals)
    if comparison is not None:
        if not isinstance(comparison, ComparisonInput):
            comparison = (
                ComparisonInput.model_validate(comparison)
                if isinstance(comparison, dict)
                else ComparisonInput.model_validate(comparison, from_attributes=True)
            )
        out += _comparison(comparison)
    out.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -f.impact, f.id))
    return out
