"""Findings: what in a run deserves attention, ranked by severity then by its cost in time (ms per
step where durations exist), each with its evidence, the view that shows it, and a concrete suggestion.

Checks on the run's aggregates (commlens.store.aggregates): latency-bound small messages per scheme (the
study's headline), rank imbalance in bytes or in time inside collectives, busbw far below the run's own
best, ZeRO-2/3 traffic multiplied by gradient accumulation (the run's config, or one supplied), and,
given a comparison with the prediction, volume above prediction and unexplained calls. Checks on the
time analysis computed at ingest (the `time_*` tables, docs/time.md) are the timing findings of
findings_time.py (exposed communication, a persistent straggler by arrival, wait-dominated collectives,
memcpy that no compute overlaps), raised only on stable evidence. Each check has a threshold below which
it stays silent (module constants).

The checks on bytes give the same findings for the same data: what decides them is sizes and counts, never
CPU op times (a gloo run's half-bandwidth size or time share moves with the host's load). Small messages
are below the half-bandwidth size measured on device kernels (else DEFAULT_SMALL_BYTES); their share of
time ranks them only when measured on the device and alike on every rank. Every byte-based finding is
capped by its evidence (`_evidence_cap`: MIN_CALLS, MEDIUM_CALLS, HIGH_CALLS). Uneven bytes are judged
only where the data hold every member of the groups and the same calls of each (`_incomparable`), uneven
time only step after step (`_time_excess`), low busbw only on device times. A suggestion names a view
only when the run has data for it (`_Views`). Evidence keeps the raw numbers; `evidence_text` shows
them with units and 3 significant digits.
"""

from __future__ import annotations

import json
from functools import cached_property
from math import fsum, sqrt
from statistics import fmean, stdev
from typing import Any

import duckdb
import pyarrow as pa
from pydantic import BaseModel

from commlens.contract.analysis import (
    SEVERITY_ORDER,
    BandwidthReport,
    ComparisonInput,
    Finding,
    RankTotals,
    Severity,
)
from commlens.contract.hang import HangGroup
from commlens.ingest.arrow_views import registered
from commlens.store.aggregates import BANDWIDTH_BOUND_FLOOR, measured_kind_sql
from commlens.vocab import format_bytes

from .bandwidth import bandwidth
from .findings_common import Steps, dur, num, pct, profiled_steps, severity_from, shown
from .findings_mismatch import calls_stop_early, collective_mismatches
from .findings_time import MIN_STEPS, short_of_floor, time_findings
from .hang import root_ranks, run_hang
from .iterations import fresh_run_id
from .ranks import rank_totals
from .timing.stragglers import DEFAULT_RULE

# Size below which a call counts as small when the run has no measured bandwidth curve for its op, and the
# floor of a measured half-bandwidth size (commlens.store.aggregates.BANDWIDTH_BOUND_FLOOR says why).
DEFAULT_SMALL_BYTES = BANDWIDTH_BOUND_FLOOR
# Ceiling on a measured half-bandwidth size. In the alpha-beta model busbw reaches half its peak at
# S = alpha x B, about 0.5-1.5 MB for NVLink or InfiniBand; a measured point far above that comes from
# kernel times stretched by overlap with compute or by waiting for a late peer, not from latency.
SMALL_BYTES_CAP = 1 << 20
SMALL_CALL_SHARE = 0.25  # fire when small calls are at least this share of a scheme's calls ...
SMALL_TIME_SHARE = 0.10  # ... or of its measured time
IMBALANCE_RATIO = 1.10  # max/mean above which ranks are uneven
LOW_BUSBW_RATIO = 0.5  # large-message busbw below this share of the run's best
MIN_LARGE_CALLS = 3
NOISE_SPREAD = DEFAULT_RULE.max_spread  # ranks' time shares agree within this share of their mean
# Evidence a byte-based finding needs, in calls: under MIN_CALLS it stays silent, under MEDIUM_CALLS it is at
# most low, under HIGH_CALLS (or on a single rank) at most medium: 8 calls of a 2-rank toy are never "high".
MIN_CALLS = 8
MEDIUM_CALLS = 64
HIGH_CALLS = 512
MIN_BYTES_SHARE = 0.05  # an uneven scheme carrying less of the run's bytes than this is at most low
# Ops whose every member moves the same bytes per call: members' totals differ only when the recording does.
_ASYMMETRIC_OPS = ("all_to_all", "send", "recv")

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


def _evidence_cap(severity: Severity, calls: int, ranks: int) -> Severity | None:
    """The severity a finding resting on `calls` calls of `ranks` ranks may have (MIN_CALLS ...)."""
    if calls < MIN_CALLS:
        return None
    cap: Severity = "low" if calls < MEDIUM_CALLS else "medium" if calls < HIGH_CALLS or ranks < 2 else "high"
    return severity if SEVERITY_ORDER[severity] >= SEVERITY_ORDER[cap] else cap


class _Views:
    """Which views have data for this run, so that a suggestion names only views that show something (each
    read when a suggestion first asks)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, run_id: int) -> None:
        self.con, self.run_id = con, run_id

    def _any(self, table: str) -> bool:
        return bool(
            self.con.execute(f"SELECT EXISTS (SELECT 1 FROM {table} WHERE run_id = ?)", [self.run_id]).fetchall()[0][0]
        )

    @cached_property
    def topology(self) -> bool:
        """NCCL topology (connection) lines."""
        return self._any("nccl_topology")

    @cached_property
    def arrivals(self) -> bool:
        """The time page's arrivals: instances matched across ranks."""
        return self._any("time_instances")


def _config(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, Any]:
    row = con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchall()[0]
    if not row or row[0] is None:
        return {}
    value = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------- small messages


def _small_messages(con: duckdb.DuckDBPyConnection, run_id: int, bw: BandwidthReport, steps: Steps) -> list[Finding]:
    # ops, and whether every measured call of each is a device kernel
    kinds = con.execute(
        "SELECT op, coalesce(bool_and(dur_kind = 'kernel') FILTER (WHERE dur_kind IS NOT NULL), false) "
        "FROM comm_agg WHERE run_id = ? GROUP BY op ORDER BY op",
        [run_id],
    ).fetchall()
    ops, kernel_ops = [str(r[0]) for r in kinds], {str(r[0]) for r in kinds if r[1]}
    # The size threshold must not move between two runs of one job: a curve measured on CPU op times
    # (gloo on a shared host) shifts its half-bandwidth bin on noise, so only device kernels set it.
    thresholds = {
        o.op: min(max(o.half_bw_bytes, DEFAULT_SMALL_BYTES), SMALL_BYTES_CAP)
        for o in bw.ops
        if o.half_bw_bytes and o.op in kernel_ops
    }
    over_cap = {o.op for o in bw.ops if o.op in thresholds and (o.half_bw_bytes or 0) > SMALL_BYTES_CAP}
    under_floor = {o.op for o in bw.ops if o.op in thresholds and (o.half_bw_bytes or 0) < DEFAULT_SMALL_BYTES}
    table = pa.table(
        {
            "op": pa.array(ops, pa.string()),
            "threshold": pa.array([thresholds.get(op, DEFAULT_SMALL_BYTES) for op in ops], pa.int64()),
            "measured": pa.array([op in thresholds for op in ops], pa.bool_()),
        }
    )
    measured = measured_kind_sql("a", "g")
    with registered(con, table) as tname:
        # From the run's aggregates: one row per (scheme, rank) with its calls, small calls and their times.
        rows = con.execute(
            f"""
            WITH c AS (
                SELECT g.scheme, a.rank_key, a.op, a.msg_bytes, a.calls, a.first_row, t.threshold, t.measured,
                       a.msg_bytes < t.threshold AS small,
                       CASE WHEN {measured} THEN a.sum_dur_us END AS dur,
                       CASE WHEN {measured} THEN a.calls ELSE 0 END AS timed,
                       CASE WHEN {measured} AND a.dur_kind = 'kernel' THEN a.calls ELSE 0 END AS on_device
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
            SELECT c.scheme, c.rank_key, sum(c.calls), coalesce(sum(c.calls) FILTER (WHERE c.small), 0), sum(c.dur),
                   sum(c.dur) FILTER (WHERE c.small), sum(c.timed), sum(c.on_device), any_value(s.top_op),
                   list(DISTINCT c.op) FILTER (WHERE c.small),
                   coalesce(sum(cast(c.msg_bytes AS HUGEINT) * c.calls) FILTER (WHERE c.small), 0)
            FROM c LEFT JOIN small_ops s ON s.scheme IS NOT DISTINCT FROM c.scheme
            GROUP BY c.scheme, c.rank_key ORDER BY c.scheme NULLS LAST, c.rank_key
            """,
            [run_id],
        ).fetchall()
    by_scheme: dict[str | None, list[tuple[Any, ...]]] = {}
    for r in rows:
        by_scheme.setdefault(r[0], []).append(r)
    run_calls = sum(r[2] for r in rows)
    run_time = sum(r[4] or 0.0 for r in rows)
    out = []
    for scheme, ranks in by_scheme.items():
        calls, small = sum(r[2] for r in ranks), sum(r[3] for r in ranks)
        time, small_time = fsum(r[4] or 0.0 for r in ranks), fsum(r[5] or 0.0 for r in ranks)
        timed, on_device = sum(r[6] for r in ranks), sum(r[7] for r in ranks)
        top_op = next((r[8] for r in ranks if r[8] is not None), None)
        # the threshold each op with small calls was judged by: the label and threshold_bytes say exactly these
        used = {op: thresholds.get(op, DEFAULT_SMALL_BYTES) for r in ranks for op in r[9] or ()}
        small_bytes = sum(int(r[10]) for r in ranks)
        if not small:
            continue
        call_share = small / calls
        # Time shares rank findings only when measured on the device for (nearly) every call and every rank
        # agrees within NOISE_SPREAD of the mean: CPU op times and disagreeing ranks are noise, not evidence.
        shares = [(r[5] or 0.0) / r[4] for r in ranks if r[4]]
        time_share = small_time / time if timed >= 0.9 * calls and time else None
        stable = (
            time_share is not None
            and on_device >= 0.9 * calls
            and len(shares) == len(ranks)
            and max(shares) - min(shares) <= NOISE_SPREAD * time_share
        )
        if call_share < SMALL_CALL_SHARE and not (stable and min(shares) >= SMALL_TIME_SHARE):
            continue
        ms, share = steps.cost(small_time) if stable else (None, None)
        if stable and share is not None:
            severity = severity_from(share, 0.25, 0.10, 0.0) or "low"
        elif stable and time_share is not None:
            severity = severity_from(time_share, 0.3, SMALL_TIME_SHARE, 0.0) or "low"
        else:
            severity = "medium" if call_share >= 0.5 else "low"
        capped = _evidence_cap(severity, calls, len(ranks))
        if capped is None:
            continue
        impact = small_time / run_time if stable and run_time else small / run_calls
        name = scheme or "unattributed"
        limit = _threshold_label(used, set(thresholds), over_cap, under_floor)
        title = (
            f"{name}: {pct(call_share)} of calls"
            + (f" and {pct(time_share)} of communication time" if stable and time_share is not None else "")
            + " are small, latency-bound messages"
        )
        stability = None
        if shares:
            spread = f"small calls' share of time {pct(min(shares))} to {pct(max(shares))} across {len(shares)} rank(s)"
            if stable:
                stability = spread
            elif on_device < 0.9 * calls:
                stability = spread + ": CPU op times, not used to rank it"
            else:
                stability = spread + ": too spread across ranks to rank it by time"
        out.append(
            Finding(
                id=f"small-messages:{name}",
                title=title,
                severity=capped,
                impact=impact,
                evidence={
                    "scheme": scheme,
                    "calls": calls,
                    "small_calls": small,
                    "small_call_share": call_share,
                    "small_time_share": time_share,
                    "small_time_us": small_time if time_share is not None else None,
                    "small_bytes": small_bytes,
                    "most_common_small_op": top_op,
                    "threshold": limit,
                    # the largest threshold used (the label names each op's where they differ), and the smallest
                    # where they differ
                    "threshold_bytes": max(used.values()) if used else None,
                    **({"threshold_bytes_min": min(used.values())} if len(set(used.values())) > 1 else {}),
                    "ranks": len(ranks),
                },
                view={"page": "histograms", "scheme": scheme, "op": top_op},
                ms_per_step=ms,
                step_share=share,
                stability=stability,
                suggestion=_SUGGEST_SMALL.get(
                    scheme or "",
                    "Find the call sites of these small calls (group and op in "
                    "the histogram) and coalesce them; below the half-bandwidth size each call "
                    "pays mostly latency.",
                ),
            )
        )
    return out


def _threshold_label(used: dict[str, int], measured: set[str], capped: set[str], raised: set[str]) -> str:
    """What "small" meant for these calls, from the thresholds actually used per op (`used`): the half-bandwidth
    size measured on the device (`measured` ops; at most SMALL_BYTES_CAP, `capped` where the curve went above
    it; at least DEFAULT_SMALL_BYTES, `raised` where it was below), else DEFAULT_SMALL_BYTES. One sentence per kind of threshold, naming the ops when they differ."""
    default_text = "default; no device-measured bandwidth curve for"
    measured_ops = sorted(op for op in used if op in measured)
    default_ops = sorted(op for op in used if op not in measured)
    if not measured_ops:
        return f"below {format_bytes(DEFAULT_SMALL_BYTES)} ({default_text} these ops)"

    def why(ops: list[str]) -> str:
        if all(op in raised for op in ops):
            return "the floor: this run's device curve reaches half its best at a smaller size, still latency-bound"
        cap = f", capped at {format_bytes(SMALL_BYTES_CAP)}" if any(op in capped for op in ops) else ""
        return f"the size where busbw reaches half its best, measured on the device in this run{cap}"

    sizes = sorted({used[op] for op in measured_ops}, reverse=True)
    if not default_ops and len(sizes) == 1:
        return f"below {format_bytes(sizes[0])} ({why(measured_ops)})"
    parts = []
    for size in sizes:
        ops = [op for op in measured_ops if used[op] == size]
        parts.append(f"below {format_bytes(size)} for {', '.join(ops)} ({why(ops)})")
    if default_ops:
        parts.append(
            f"below {format_bytes(DEFAULT_SMALL_BYTES)} for {', '.join(default_ops)} ({default_text} "
            + ("it)" if len(default_ops) == 1 else "them)")
        )
    return "; ".join(parts)


# ----------------------------------------------------------------------------------- ranks


def _pp_chain_ratio(con: duckdb.DuckDBPyConnection, run_id: int) -> float:
    """Expected max/mean of per-rank pp bytes for a pipeline chain: the end stages talk to one
    neighbour, interior stages to two, so p stages give p / (p - 1)."""
    sql = "SELECT max(size) FROM process_groups WHERE run_id = ? AND scheme = 'pp'"
    p = con.execute(sql, [run_id]).fetchall()[0][0]
    return p / (p - 1) if p and p > 2 else 1.0


def _incomparable(
    con: duckdb.DuckDBPyConnection, run_id: int, totals: RankTotals
) -> dict[str | None, dict[str, str | None]]:
    """Per scheme and per basis, why its ranks' bytes cannot be compared (None: they can): a group (for
    calls without one, the world) with members missing from the data, or members whose recordings of one
    symmetric op differ in calls (an excerpt or a profiler window cut at another call), so that a rank
    seems to carry more only because more of it was recorded."""
    iterations = {r.rank: r.iterations for r in totals.rows}
    rows = con.execute(
        """
        SELECT g.scheme, a.group_key, max(coalesce(g.size, a.max_group_size)), a.op, a.rank_key, sum(a.calls),
               coalesce(sum(a.calls) FILTER (WHERE a.in_iteration), 0)
        FROM comm_agg a LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
        WHERE a.run_id = ? AND a.msg_bytes IS NOT NULL
        GROUP BY ALL ORDER BY 1 NULLS LAST, 2, 4, 5
        """,
        [run_id],
    ).fetchall()
    members: dict[tuple[str | None, str | None], set[str]] = {}
    size: dict[tuple[str | None, str | None], int | None] = {}
    calls: dict[tuple[str | None, str | None, str], dict[str, tuple[int, int]]] = {}
    world = con.execute("SELECT world_size FROM runs WHERE run_id = ?", [run_id]).fetchall()[0][0]
    for scheme, group, n, op, rank, total, in_it in rows:
        members.setdefault((scheme, group), set()).add(rank)
        size[(scheme, group)] = n if group is not None else world  # calls without a group: the whole world
        if op not in _ASYMMETRIC_OPS:
            calls.setdefault((scheme, group, op), {})[rank] = (int(total), int(in_it))
    out: dict[str | None, dict[str, str | None]] = {}
    for basis in ("total", "per_iteration"):
        for (scheme, group), ranks in members.items():
            why = None
            n = size[(scheme, group)]
            if n is None:
                why = "calls without a known process group or world size"
            elif len(ranks) < n:
                why = f"{group or 'the world'} has {len(ranks)} of its {n} ranks in the data"
            else:
                for (s, g, op), per in calls.items():
                    if (s, g) != (scheme, group):
                        continue
                    seen: set[float]
                    if basis == "total":
                        seen = {float(c) for c, _ in per.values()}
                    else:
                        seen = {round(i / (iterations.get(r) or 1), 6) for r, (_, i) in per.items()}
                    if len(seen) > 1:
                        why = (
                            f"the members of group {group} recorded different numbers of {op} calls "
                            f"({num(min(seen))} to {num(max(seen))}{' per iteration' if basis != 'total' else ''}): "
                            "their recordings cover different spans"
                        )
                        break
            for key in (scheme, ALL_SCHEMES):
                reasons = out.setdefault(key, {})
                if reasons.get(basis) is None:
                    reasons[basis] = why
    return out


ALL_SCHEMES = "*"  # the key of the run as a whole in _incomparable


def _time_excess(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    scheme: str | None,
    all_schemes: bool,
    rank: str,
    mean_step_us: float | None,
) -> tuple[str | None, str]:
    """Whether a rank's extra time inside collectives holds step after step: (why it is noise or None, its
    stability in words). Per step with every rank present, the excess is the most loaded rank's time over
    the mean; it must span MIN_STEPS steps, fall on `rank` in DEFAULT_RULE.step_share of the steps, and be
    well above the timing findings' floor (findings_time.short_of_floor)."""
    rows = con.execute(
        """
        SELECT e.step, coalesce(cast(e.rank AS VARCHAR), e.process, '?') AS rk, sum(e.dur_us)
        FROM comm_events e LEFT JOIN process_groups g ON g.run_id = e.run_id AND g.group_key = e.group_key
        WHERE e.run_id = $run AND e.counted AND e.step IS NOT NULL AND e.dur_us > 0
          AND (e.dur_source = 'kernel' OR (e.dur_source = 'cpu_op' AND lower(coalesce(g.backend, '')) NOT LIKE '%nccl%'))
          AND ($all OR g.scheme IS NOT DISTINCT FROM $scheme)
        GROUP BY 1, 2 ORDER BY 1, 2
        """,
        {"run": run_id, "all": all_schemes, "scheme": scheme},
    ).fetchall()
    by_step: dict[int, dict[str, float]] = {}
    for step, rk, d in rows:
        by_step.setdefault(int(step), {})[str(rk)] = float(d)
    ranks = set().union(*(set(v) for v in by_step.values())) if by_step else set()
    excess, top = [], []
    for per in by_step.values():
        if set(per) == ranks and len(ranks) > 1:
            excess.append(max(per.values()) - fmean(per.values()))
            top.append(max(per, key=lambda r: (per[r], r)))
    if len(excess) < MIN_STEPS:
        return f"too few profiled steps to tell: {len(excess)} step(s) with every rank timed", (
            "stability across steps unknown"
        )
    mean, spread = fmean(excess), stdev(excess)
    se = spread / sqrt(len(excess))
    most = top.count(rank)
    text = (
        f"rank {rank} the most loaded in {most} of {len(top)} steps; {dur(mean)} ± {dur(spread)} "
        f"above the mean per step, standard error {dur(se)}"
    )
    if most < DEFAULT_RULE.step_share * len(top):
        return "not the same rank step after step", text
    return short_of_floor(mean, se, mean_step_us), text


def _imbalance(
    con: duckdb.DuckDBPyConnection, run_id: int, totals: RankTotals, steps: Steps, by_arrival: bool, views: _Views
) -> list[Finding]:
    """Uneven bytes, or uneven time inside collectives. Bytes are compared only where the data hold every
    member of the groups and the same calls of each (`_incomparable`). Time inside a collective is mostly
    waiting for the last member, so its most loaded rank is usually one that was on time: where the run has
    the arrival analysis (`by_arrival`), the straggler and wait findings replace the time imbalance, and
    without it the time imbalance needs iterations to compare and is never high."""
    run_bytes = sum(r.bytes for r in totals.rows) or 1
    run_time = sum(r.time_us or 0.0 for r in totals.rows) or None
    out: list[Finding] = []
    fired: set[str] = set()
    schemes = {r.scheme for r in totals.rows}
    chain = _pp_chain_ratio(con, run_id) if "pp" in schemes else 1.0
    blocked: dict[str | None, dict[str, str | None]] | None = None  # read for the first candidate only
    for imb in sorted(totals.imbalance, key=lambda i: i.all_schemes):  # per scheme first, then overall
        # The overall view only adds something when several schemes mix and none was uneven alone.
        if imb.all_schemes and (imb.metric in fired or len(schemes) < 2):
            continue
        if imb.metric == "time_us" and (by_arrival or imb.basis != "per_iteration"):
            continue
        expected = chain if (imb.scheme == "pp" or imb.all_schemes) and imb.metric == "bytes" else 1.0
        ratio = imb.max_over_mean / expected
        severity = severity_from(ratio, 1.5, 1.25, IMBALANCE_RATIO)
        if severity is None:
            continue
        blocked = _incomparable(con, run_id, totals) if blocked is None else blocked
        if blocked.get(ALL_SCHEMES if imb.all_schemes else imb.scheme, {}).get(imb.basis):
            continue
        rows = [r for r in totals.rows if imb.all_schemes or r.scheme == imb.scheme]
        stability: str | None = None
        if imb.metric == "bytes":
            impact = sum(r.bytes for r in rows) / run_bytes
            if impact < MIN_BYTES_SHARE:
                severity = "low"
        else:
            impact = sum(r.time_us or 0.0 for r in rows) / run_time if run_time else 0.0
            noise, stability = _time_excess(con, run_id, imb.scheme, imb.all_schemes, imb.max_rank, steps.mean_us)
            if noise is not None:
                continue
            severity = "low" if severity == "high" else severity
        capped = _evidence_cap(severity, sum(r.calls for r in rows), imb.ranks)
        if capped is None:
            continue
        fired.add(imb.metric)
        name = "all schemes" if imb.all_schemes else imb.scheme or "unattributed"
        what = "bytes"
        ms = share = None
        if imb.metric == "time_us" and steps.ranks:
            # the most loaded rank's time above the mean, per step (totals spread over a rank's steps)
            ms, share = steps.cost((imb.max - imb.mean) * steps.rank_steps)
        if imb.metric == "bytes":
            suggestion = (
                f"Rank {imb.max_rank} moves {num(imb.max_over_mean)}x the mean {what} in {name}. Check uneven "
                "sharding or bucket assignment, pipeline stages with unequal layer counts, or skewed expert "
                "routing; balance the work so no rank carries more traffic than its peers."
            )
        else:
            what = "time inside collectives"
            see = (
                "the time page's arrivals name who arrives last"
                if views.arrivals
                else "profile every rank with CUDA activities so that the arrivals name who arrives last"
            )
            suggestion = (
                f"Rank {imb.max_rank} spends {num(imb.max_over_mean)}x the mean {what} in {name}. That time is "
                "mostly waiting for the last member to arrive, so the rank with the most is usually one that "
                f"was on time, not the one everybody waits for: {see}, or compare the ranks' compute per step."
            )
        title = f"{name}: uneven {what} across ranks (max/mean {num(imb.max_over_mean)}, rank {imb.max_rank})"
        out.append(
            Finding(
                id=f"imbalance:{name}:{imb.metric}",
                title=title,
                severity=capped,
                impact=impact,
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
                ms_per_step=ms,
                step_share=share,
                stability=stability,
                suggestion=suggestion,
            )
        )
    return out


# ------------------------------------------------------------------------------- bandwidth


def _on_device(con: duckdb.DuckDBPyConnection, run_id: int) -> set[tuple[str | None, str]]:
    """The (scheme, op) pairs whose every measured call is a device kernel."""
    return {
        (r[0], str(r[1]))
        for r in con.execute(
            """
            SELECT g.scheme, a.op FROM comm_agg a
            LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
            WHERE a.run_id = ? AND a.dur_kind IS NOT NULL GROUP BY ALL HAVING bool_and(a.dur_kind = 'kernel')
            """,
            [run_id],
        ).fetchall()
    }


def _low_busbw(
    con: duckdb.DuckDBPyConnection, run_id: int, bw: BandwidthReport, steps: Steps, views: _Views
) -> list[Finding]:
    """Bandwidth-bound calls of a (scheme, op) far below the run's best busbw, on device kernel times only:
    CPU op times (gloo on one host) say nothing about links and move with the host's load."""
    best = bw.best_busbw_gbps
    if not best:
        return []
    on_device: set[tuple[str | None, str]] | None = None  # read for the first candidate only
    total_time = sum(s.time_us for s in bw.by_scheme) or 1.0
    out = []
    for s in bw.by_scheme:
        if s.large_calls < MIN_LARGE_CALLS or s.large_median_busbw_gbps is None:
            continue
        ratio = s.large_median_busbw_gbps / best
        severity: Severity | None = "high" if ratio < 0.25 else "medium" if ratio < LOW_BUSBW_RATIO else None
        if severity is None or (severity := _evidence_cap(severity, s.large_calls, 2)) is None:
            continue
        on_device = _on_device(con, run_id) if on_device is None else on_device
        if (s.scheme, s.op) not in on_device:
            continue
        name = s.scheme or "unattributed"
        ms, share = steps.cost(s.time_us * (1 - ratio))  # the time above what the run's best busbw takes
        links = (
            "Compare this group's links with the best one (topology page): a group"
            if views.topology
            else "Check where this group's ranks run (the logs hold no NCCL topology lines; NCCL_DEBUG=INFO "
            "writes them): a group"
        )
        out.append(
            Finding(
                id=f"low-busbw:{name}:{s.op}",
                title=f"{name} {s.op}: bandwidth-bound calls reach {pct(ratio)} of the run's best busbw",
                severity=severity,
                impact=s.time_us / total_time,
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
                ms_per_step=ms,
                step_share=share,
                suggestion=f"{links} spanning nodes runs "
                "at network speed, so place this dimension inside a node if the mesh allows; otherwise check "
                "NCCL's algorithm/protocol choice and channel count for these sizes, and contention with "
                "overlapping collectives of other groups.",
            )
        )
    return out


# ------------------------------------------------------------------------------ run config


def _predicted_dp_ratio(config: dict[str, Any], baseline_stage: int) -> float | None:
    """dp wire bytes per iteration the predictor gives this configuration over those of the same one at
    `baseline_stage`, or None when it predicts either not (a configuration it cannot read)."""
    from .predict import predict, predict_input_from_config

    try:
        inp = predict_input_from_config(config)
        base = inp.model_copy(update={"parallel": inp.parallel.model_copy(update={"zero": baseline_stage})})
        wires = [sum(t.wire_bytes for t in predict(x).totals if t.scheme == "dp") for x in (inp, base)]
    except ValueError:
        return None
    return wires[0] / wires[1] if wires[1] > 0 else None


def _zero_accumulation(config: dict[str, Any], totals: RankTotals) -> list[Finding]:
    parallel = config.get("parallel") or {}
    zero, m = int(parallel.get("zero") or 0), int(parallel.get("micro_batches") or 1)
    if zero < 2 or m < 2:
        return []
    # docs/models.md §6.2 with w_param = w_grad: ZeRO-2 moves m*G + P where ZeRO-1 moves G + P;
    # ZeRO-3 moves m*(2P + G) where stage 0 moves 2G (ring wire bytes): ratios (m + 1) / 2 and 3m / 2. The
    # predictor's own ratio for this configuration replaces that estimate where it predicts both stages (its
    # dtypes, buckets and unsharded tensors make it differ: 2.73x, not 3.0x, for a small harness ZeRO-3 run).
    ratio, baseline = ((m + 1) / 2, "ZeRO-1") if zero == 2 else (3 * m / 2, "DDP (stage 0)")
    ratio_source = "estimate (docs/models.md §6.2, parameters and gradients of one width)"
    predicted = _predicted_dp_ratio(config, 1 if zero == 2 else 0)
    if predicted is not None:
        ratio, ratio_source = predicted, "the predictor's dp wire bytes of this configuration against the baseline's"
    severity = severity_from(ratio, 4.0, 2.0, 1.0)
    dp_bytes = sum(r.bytes for r in totals.rows if r.scheme == "dp")
    all_bytes = sum(r.bytes for r in totals.rows)
    dp_share = dp_bytes / all_bytes if all_bytes else 1.0
    per_it = [r.bytes_per_iteration for r in totals.rows if r.scheme == "dp" and r.bytes_per_iteration is not None]
    return [
        Finding(
            id="zero-accumulation",
            severity=severity or "low",
            impact=(1 - 1 / ratio) * dp_share,
            title=f"ZeRO-{zero} with {m} accumulation micro-steps: about {ratio:.1f}x the data-parallel traffic "
            f"of {baseline}",
            evidence={
                "zero_stage": zero,
                "micro_batches": m,
                "predicted_ratio": ratio,
                "ratio_from": ratio_source,
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
    # measured_bytes is what the prediction explains; the unexplained bytes are measured too
    total = sum(s.measured_bytes + s.unexplained_bytes for s in comparison.per_scheme) or 1.0
    out = []
    for s in comparison.per_scheme:
        excess = (
            (s.measured_bytes - s.predicted_bytes) / s.predicted_bytes
            if s.predicted_bytes
            else (float("inf") if s.measured_bytes > 0 else 0.0)
        )
        if excess > comparison.tolerance:
            severity = severity_from(excess, 0.5, 0.2, comparison.tolerance)
            out.append(
                Finding(
                    id=f"above-prediction:{s.scheme}",
                    severity=severity or "low",
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
            measured = s.measured_bytes + s.unexplained_bytes
            share = s.unexplained_bytes / measured if measured else 0.0
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


def _hang(groups: list[HangGroup]) -> list[Finding]:
    """The job hung (Flight Recorder): where it starts, and the call its peers wait in."""
    if not groups:
        return []
    roots = root_ranks(groups)
    first = next((g for g in groups if set(roots) & set(g.missing_ranks)), groups[0])
    doing = next((x.doing for x in first.ranks if x.rank in roots), "")
    who = ", ".join(map(str, roots))
    return [
        Finding(
            id="hang",
            severity="high",
            impact=1.0,
            title=f"The job hung: rank {who} never arrived at {first.op} #{first.seq} in {first.group}",
            evidence={
                "root_ranks": who,
                "group": first.group,
                "op": first.op,
                "seq": first.seq,
                "arrived_ranks": ", ".join(map(str, first.arrived_ranks)),
                "doing": doing,
                "groups_hung": len(groups),
            },
            view={"page": "overview"},
            suggestion=f"Look at what rank {who} was doing instead ({doing}): an exception or a blocking wait "
            "outside collectives, or control flow that skips a collective its peers make; the other missing "
            "ranks wait in calls it never entered. The Hang section lists every group's latest call.",
            ranks=roots,
        )
    ]


def findings(
    con: duckdb.DuckDBPyConnection, run: str, comparison: Any = None, config: BaseModel | dict[str, Any] | None = None
) -> list[Finding]:
    """All findings of a run, most severe first, then the most costly in time per step, then the most
    impactful. `comparison` is a ComparisonInput or any object/dict with per_scheme entries (scheme,
    predicted_bytes, measured_bytes, unexplained_calls). `config` (a PredictInput, run.json or dict with a `parallel` section) replaces
    the run's stored config, as a config supplied to `commlens report --config` does."""
    run_id = fresh_run_id(con, run)
    bw = bandwidth(con, run)
    totals = rank_totals(con, run)
    steps = profiled_steps(con, run_id)
    timed, by_arrival = time_findings(con, run_id)
    views = _Views(con, run_id)
    out = (
        timed
        + _small_messages(con, run_id, bw, steps)
        + _imbalance(con, run_id, totals, steps, by_arrival, views)
        + _low_busbw(con, run_id, bw, steps, views)
        + collective_mismatches(con, run_id)
        + calls_stop_early(con, run_id)
        + _hang(run_hang(con, run_id))
    )
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
    for f in out:
        f.evidence_text = {k: shown(k, v, f.evidence) for k, v in f.evidence.items() if v is not None}
    out.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -(f.ms_per_step or 0.0), -f.impact, f.id))
    return out
