"""Findings: what in a run deserves attention, ranked by severity then by its cost in time (ms per
step where durations exist), each with its evidence, the view that shows it, and a concrete suggestion.

Checks on the run's aggregates (commlens.store.aggregates): latency-bound small messages per scheme (the
study's headline), rank imbalance in bytes or in time inside collectives, busbw far below the run's own
best, ZeRO-2/3 traffic multiplied by gradient accumulation (the run's config, or one supplied), and,
given a comparison with the prediction, volume above prediction and unexplained calls. Checks on the
time analysis computed at ingest (the `time_*` tables, docs/time.md): exposed communication per scheme,
a persistent straggler (by arrival, never by time inside collectives), collectives whose wait dominates
their duration, and memcpy that no compute overlaps. Those read per-rank sums that the ingest service
stores after the time tables (`store_timing_inputs`), never the run's (rank, step) cells or member rows.

A timing finding states its stability across steps and ranks and is not raised on noise: fewer than
MIN_STEPS steps (unless a single step shows it on each of MIN_RANKS ranks or more), or a spread across
steps within a rank above NOISE_SPREAD of the effect (the straggler rule's test: the effect must be at
least twice its spread). Severity scales with
the cost (ms per step as a share of the step) and drops a level on thin evidence (under STRONG_STEPS
steps or a single rank). Each check has a threshold below which it stays silent (module constants).

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
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from math import fsum, sqrt
from statistics import fmean
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
from commlens.store import transaction
from commlens.store.aggregates import measured_kind_sql, registered
from commlens.store.tables import TIME_FINDING_TABLES
from commlens.vocab import format_bytes

from .bandwidth import bandwidth
from .iterations import fresh_run_id
from .ranks import rank_totals
from .timing.stragglers import DEFAULT_RULE

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
# Timing findings (module doc): evidence needs MIN_STEPS steps, a spread across steps no larger than the
# effect, and a cost of MIN_TIME_SHARE of the mean step; STRONG_STEPS steps on 2+ ranks keep the severity.
MIN_STEPS = 2
NOISE_SPREAD = DEFAULT_RULE.max_spread  # the straggler rule's test of noise, for every timing finding
MIN_RANKS = 4  # a single profiled step is evidence only when this many ranks show it
STRONG_STEPS = 4
MIN_TIME_SHARE = 0.05
WAIT_DOMINATES = 0.5  # a collective's members spend at least this share of their time in it waiting
TOP_INSTANCES = 20  # instance ids a finding links to (the largest skews first)
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


def _severity(value: float, high: float, medium: float, low: float, higher_is_worse: bool = True) -> Severity | None:
    if not higher_is_worse:
        value, high, medium, low = -value, -high, -medium, -low
    if value >= high:
        return "high"
    if value >= medium:
        return "medium"
    if value >= low:
        return "low"
    return None


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


def _time_severity(share: float, steps: int, ranks: int) -> Severity | None:
    """Severity from the cost (share of the step), one level lower on thin evidence."""
    sev = _severity(share, 0.25, 0.10, MIN_TIME_SHARE)
    if sev is None:
        return None
    if steps < STRONG_STEPS or ranks < 2:
        return "medium" if sev == "high" else "low"
    return sev


@dataclass(frozen=True)
class _Rank:
    """One rank's (rank, step) cells of a quantity, summarised at ingest (time_finding_cells)."""

    cells: int
    value_us: float  # the cells' values summed
    m2: float  # squared deviations from the rank's mean value, summed
    step_us: float  # the cells' step times summed
    weak: bool  # some cell is under MIN_TIME_SHARE of its step


@dataclass
class _Cells:
    """A quantity's values per (rank, step), as per-rank sums: a request reads O(ranks) numbers, not the
    run's cells. `steps` reads the sorted steps the cells span (only for a finding that is raised)."""

    ranks: dict[int, _Rank]
    n_steps: int
    steps: Callable[[], list[int]]

    def per_rank(self) -> dict[int, float]:
        return {r: x.value_us / x.cells for r, x in sorted(self.ranks.items())}

    def count(self) -> int:
        return sum(x.cells for x in self.ranks.values())

    def mean(self) -> float:
        return fsum(x.value_us for x in self.ranks.values()) / self.count()

    def mean_step(self) -> float:
        return fsum(x.step_us for x in self.ranks.values()) / self.count()

    def spread(self) -> float:
        """The spread across steps within a rank (the root of the ranks' mean variance): ranks differ by
        design (the one waited for waits least), so only each rank's own variation is noise."""
        return sqrt(fmean([x.m2 / (x.cells - 1) for x in self.ranks.values() if x.cells > 1] or [0.0]))


def _noise(cells: _Cells) -> str | None:
    """Why a timing finding's values are noise; None when they are evidence. Over MIN_STEPS steps or
    more the spread across steps within a rank must be at most NOISE_SPREAD of the effect; a single
    step is evidence only when at least MIN_RANKS ranks each show MIN_TIME_SHARE of their step."""
    n_steps, per_rank, mean = cells.n_steps, cells.per_rank(), cells.mean()
    if n_steps >= MIN_STEPS:
        spread = cells.spread()
        if mean <= 0 or spread > NOISE_SPREAD * mean:
            return f"spread across steps {_dur(spread)} against an effect of {_dur(mean)}"
        return None
    if len(per_rank) < MIN_RANKS:
        return f"{n_steps} step(s) on {len(per_rank)} rank(s): consistency needs {MIN_STEPS} steps or {MIN_RANKS} ranks"
    weak = [r for r, x in sorted(cells.ranks.items()) if x.weak]
    return f"one step, and ranks {weak} show under {_pct(MIN_TIME_SHARE)} of it" if weak else None


def _num(x: float, digits: int = 3) -> str:
    """Significant digits, trailing zeros kept ("25.0", "0.250"), without scientific notation (12,345
    rather than 1.23e+04)."""
    if abs(x) >= 10 ** (digits - 1) or x == 0:
        return f"{x:,.0f}"
    return f"{x:#.{digits}g}".rstrip(".")


def _dur(us: float) -> str:
    if abs(us) >= 1e6:
        return f"{_num(us / 1e6)} s"
    return f"{_num(us / 1e3)} ms" if abs(us) >= 1e3 else f"{_num(us)} µs"


def _pct(x: float) -> str:
    return f"{_num(100 * x, 2)}%"


def _shown(key: str, value: float | int | str, evidence: dict[str, float | int | str | None]) -> str:
    """One evidence value for people, by what its key (or, for a max and mean, the metric beside it) says
    it is."""
    if isinstance(value, str):
        return value
    if key in ("max", "mean") and evidence.get("metric") in ("bytes", "time_us"):
        key = f"{key}_{evidence['metric']}"
    if key.endswith("_us"):
        return _dur(value)
    if key.endswith("ms_per_step"):
        return f"{_num(value)} ms"
    if key.endswith("_gbps"):
        return f"{_num(value)} GB/s"
    if "bytes" in key:
        return format_bytes(int(value))
    if "share" in key or key in ("ratio", "excess", "tolerance"):
        return _pct(value)
    if key.endswith(("over_mean", "_ratio")):
        return f"{_num(value)}x"
    return f"{value:,}" if isinstance(value, int) else _num(value)


def _stability(cells: _Cells) -> str:
    """Mean ± the spread across steps within a rank, and the range across ranks."""
    per_rank = cells.per_rank()
    if cells.n_steps < MIN_STEPS:  # one step: only the ranks say how stable it is
        text = f"one profiled step (stability across steps unknown): {_dur(cells.mean())}"
    else:
        text = f"{_dur(cells.mean())} ± {_dur(cells.spread())} per step over {cells.n_steps} steps"
    if len(per_rank) > 1:
        lo, hi = min(per_rank, key=lambda r: (per_rank[r], r)), max(per_rank, key=lambda r: (per_rank[r], -r))
        text += f"; {_dur(per_rank[lo])} (rank {lo}) to {_dur(per_rank[hi])} (rank {hi}) across {len(per_rank)} ranks"
    return text


@dataclass(frozen=True)
class _Steps:
    """The run's profiled steps: (rank, step) pairs, ranks and the mean step (µs)."""

    rank_steps: int
    ranks: int
    mean_us: float | None

    def cost(self, total_us: float | None) -> tuple[float | None, float | None]:
        """(ms per step and rank, share of the mean step) of a time summed over every rank and step."""
        if total_us is None or not self.rank_steps:
            return None, None
        per_step = total_us / self.rank_steps
        return per_step / 1e3, per_step / self.mean_us if self.mean_us else None


# The run's profiled steps: (rank, step) pairs, ranks, the mean of each pair's longest duration.
_STEPS_SQL = """
    SELECT count(*), count(DISTINCT rank), avg(d) FROM (
        SELECT rank, step, max(dur_us) AS d FROM steps WHERE run_id = $run AND rank IS NOT NULL GROUP BY rank, step
    )"""


def _steps(con: duckdb.DuckDBPyConnection, run_id: int) -> _Steps:
    """The run's steps as stored with its timing inputs, else (a run not analysed since the store's upgrade)
    from its steps."""
    rows = (
        con.execute(
            "SELECT rank_steps, ranks, mean_step_us FROM time_finding_runs WHERE run_id = ?", [run_id]
        ).fetchall()
        or con.execute(_STEPS_SQL, {"run": run_id}).fetchall()
    )
    n, ranks, mean = rows[0]
    return _Steps(int(n), int(ranks), mean)


def _config(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, Any]:
    row = con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchall()[0]
    if not row or row[0] is None:
        return {}
    value = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------- small messages


def _small_messages(con: duckdb.DuckDBPyConnection, run_id: int, bw: BandwidthReport, steps: _Steps) -> list[Finding]:
    # ops, and whether every measured call of each is a device kernel
    kinds = con.execute(
        "SELECT op, coalesce(bool_and(dur_kind = 'kernel') FILTER (WHERE dur_kind IS NOT NULL), false) "
        "FROM comm_agg WHERE run_id = ? GROUP BY op ORDER BY op",
        [run_id],
    ).fetchall()
    ops, kernel_ops = [str(r[0]) for r in kinds], {str(r[0]) for r in kinds if r[1]}
    # The size threshold must not move between two runs of one job: a curve measured on CPU op times
    # (gloo on a shared host) shifts its half-bandwidth bin on noise, so only device kernels set it.
    thresholds = {o.op: min(o.half_bw_bytes, SMALL_BYTES_CAP) for o in bw.ops if o.half_bw_bytes and o.op in kernel_ops}
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
                   bool_and(c.measured) FILTER (WHERE c.small), max(c.threshold) FILTER (WHERE c.small),
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
        all_measured = all(r[9] for r in ranks if r[9] is not None)
        threshold = max((r[10] for r in ranks if r[10] is not None), default=None)
        small_bytes = sum(int(r[11]) for r in ranks)
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
            severity = _severity(share, 0.25, 0.10, 0.0) or "low"
        elif stable and time_share is not None:
            severity = _severity(time_share, 0.3, SMALL_TIME_SHARE, 0.0) or "low"
        else:
            severity = "medium" if call_share >= 0.5 else "low"
        capped = _evidence_cap(severity, calls, len(ranks))
        if capped is None:
            continue
        impact = small_time / run_time if stable and run_time else small / run_calls
        name = scheme or "unattributed"
        limit = (
            f"below the size where busbw reaches half its best (measured per op on the device in this run, at most "
            f"{format_bytes(SMALL_BYTES_CAP)})"
            if all_measured
            else f"below {format_bytes(DEFAULT_SMALL_BYTES)} (default; no device-measured bandwidth curve for these ops)"
        )
        title = (
            f"{name}: {_pct(call_share)} of calls"
            + (f" and {_pct(time_share)} of communication time" if stable and time_share is not None else "")
            + " are small, latency-bound messages"
        )
        stability = None
        if shares:
            spread = (
                f"small calls' share of time {_pct(min(shares))} to {_pct(max(shares))} across {len(shares)} rank(s)"
            )
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
                    "threshold_bytes": int(threshold) if threshold else None,
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
                            f"({_num(min(seen))} to {_num(max(seen))}{' per iteration' if basis != 'total' else ''}): "
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
    con: duckdb.DuckDBPyConnection, run_id: int, scheme: str | None, all_schemes: bool, rank: str
) -> tuple[str | None, str]:
    """Whether a rank's extra time inside collectives holds step after step: (why it is noise or None, its
    stability in words). Per step with every rank present, the excess is the most loaded rank's time over
    the mean; it must span MIN_STEPS steps, vary by at most NOISE_SPREAD of its mean, and fall on `rank`
    in DEFAULT_RULE.step_share of the steps."""
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
    for step, rk, dur in rows:
        by_step.setdefault(int(step), {})[str(rk)] = float(dur)
    ranks = set().union(*(set(v) for v in by_step.values())) if by_step else set()
    excess, top = [], []
    for per in by_step.values():
        if set(per) == ranks and len(ranks) > 1:
            excess.append(max(per.values()) - fmean(per.values()))
            top.append(max(per, key=lambda r: (per[r], r)))
    if len(excess) < MIN_STEPS:
        return f"{len(excess)} step(s) with every rank timed", "stability across steps unknown"
    mean, spread = fmean(excess), sqrt(fmean([(x - fmean(excess)) ** 2 for x in excess]))
    most = top.count(rank)
    text = (
        f"rank {rank} the most loaded in {most} of {len(top)} steps; {_dur(mean)} ± {_dur(spread)} "
        "above the mean per step"
    )
    if mean <= 0 or spread > NOISE_SPREAD * mean or most < DEFAULT_RULE.step_share * len(top):
        return "not the same rank, or not the same excess, step after step", text
    return None, text


def _imbalance(
    con: duckdb.DuckDBPyConnection, run_id: int, totals: RankTotals, steps: _Steps, by_arrival: bool, views: _Views
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
        severity = _severity(ratio, 1.5, 1.25, IMBALANCE_RATIO)
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
            noise, stability = _time_excess(con, run_id, imb.scheme, imb.all_schemes, imb.max_rank)
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
                f"Rank {imb.max_rank} moves {_num(imb.max_over_mean)}x the mean {what} in {name}. Check uneven "
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
                f"Rank {imb.max_rank} spends {_num(imb.max_over_mean)}x the mean {what} in {name}. That time is "
                "mostly waiting for the last member to arrive, so the rank with the most is usually one that "
                f"was on time, not the one everybody waits for: {see}, or compare the ranks' compute per step."
            )
        title = f"{name}: uneven {what} across ranks (max/mean {_num(imb.max_over_mean)}, rank {imb.max_rank})"
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
    con: duckdb.DuckDBPyConnection, run_id: int, bw: BandwidthReport, steps: _Steps, views: _Views
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
                title=f"{name} {s.op}: bandwidth-bound calls reach {_pct(ratio)} of the run's best busbw",
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
            impact=(1 - 1 / ratio) * dp_share,
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


# ------------------------------------------------------------------------------------- time

# ---------------------------------------------------------------------------- timing inputs at ingest

# The cells of each timing finding's quantity, (key, op, rank, step, step_us, v, dur) per (rank, step):
# the breakdown's cells are every (rank, step) with a step time, a scheme absent from one counting 0 there;
# the waits' cells are the instance members' waits, against the mean step.
_WHOLE = """
    whole AS (
        SELECT rank, step, step_us, memcpy_us FROM time_breakdown
        WHERE run_id = $run AND scheme IS NULL AND step_us > 0
    )"""
_SCHEME_CELLS = (
    _WHOLE
    + """, schemes AS (SELECT DISTINCT scheme FROM time_breakdown WHERE run_id = $run AND scheme IS NOT NULL),
    cells AS (
        SELECT s.scheme AS key, '' AS op, w.rank, w.step, w.step_us, coalesce({column}, 0) AS v, NULL::DOUBLE AS dur
        FROM schemes s CROSS JOIN whole w
        LEFT JOIN time_breakdown b ON b.run_id = $run AND b.scheme = s.scheme AND b.rank = w.rank AND b.step = w.step
    )"""
)
_CELLS = {
    "exposed": _SCHEME_CELLS.format(column="b.wait_us + b.exposed_us"),
    "wait": _SCHEME_CELLS.format(column="b.wait_us"),
    "memcpy": _WHOLE
    + """, cells AS (
        SELECT '' AS key, '' AS op, rank, step, step_us, coalesce(memcpy_us, 0) AS v, NULL::DOUBLE AS dur FROM whole
    )""",
    # the wait of every member but the straggler, per group with one
    "straggler": """
    cells AS (
        SELECT i.group_key AS key, '' AS op, m.rank, i.step, $mean::DOUBLE AS step_us, sum(m.wait_us) AS v,
               NULL::DOUBLE AS dur
        FROM time_stragglers t
        JOIN time_instances i ON i.run_id = t.run_id AND i.group_key = t.group_key
        JOIN time_instance_members m ON m.run_id = i.run_id AND m.instance_id = i.instance_id
        WHERE t.run_id = $run AND t.straggler AND m.wait_us IS NOT NULL AND m.rank IS DISTINCT FROM t.rank
        GROUP BY i.group_key, m.rank, i.step
    )""",
    "wait_dominated": """
    cells AS (
        SELECT coalesce(i.scheme, 'unattributed') AS key, i.op, m.rank, i.step, $mean::DOUBLE AS step_us,
               sum(m.wait_us) AS v, sum(m.end_ref_us - m.arrival_ref_us) AS dur
        FROM time_instances i
        JOIN time_instance_members m ON m.run_id = i.run_id AND m.instance_id = i.instance_id
        WHERE i.run_id = $run AND m.wait_us IS NOT NULL AND m.end_ref_us IS NOT NULL AND i.step IS NOT NULL
        GROUP BY ALL
    )""",
}


def store_timing_inputs(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Summarise the run's time tables into what its timing findings read (time_finding_cells per kind,
    key and rank; time_finding_keys per kind and key; time_finding_runs: its steps and memcpy totals),
    replacing the run's rows in one transaction. A findings request then reads O(keys x ranks) rows
    instead of every (rank, step) cell and member row: call it after every write of the time tables
    (commlens.backend.timing.persist.persist_run)."""

    def write(c: duckdb.DuckDBPyConnection) -> None:
        for table in TIME_FINDING_TABLES:
            c.execute(f"DELETE FROM {table} WHERE run_id = $run", {"run": run_id})
        c.execute(
            f"""
            INSERT INTO time_finding_runs
            WITH s AS ({_STEPS_SQL}), m AS (
                SELECT direction, sum(bytes) AS b, sum(busy_us) AS busy FROM time_memcpy WHERE run_id = $run
                GROUP BY direction
            )
            SELECT $run, s.*,
                   (SELECT b FROM m WHERE direction = 'htod'), (SELECT busy FROM m WHERE direction = 'htod'),
                   (SELECT b FROM m WHERE direction = 'dtoh'), (SELECT busy FROM m WHERE direction = 'dtoh')
            FROM s
            """,
            {"run": run_id},
        )
        mean_step = c.execute(
            "SELECT avg(step_us) FROM time_breakdown WHERE run_id = ? AND scheme IS NULL AND step_us > 0", [run_id]
        ).fetchall()[0][0]
        for kind, cells in _CELLS.items():
            params = {"run": run_id, "kind": kind, "share": MIN_TIME_SHARE} | (
                {"mean": mean_step} if "$mean" in cells else {}
            )
            c.execute(
                f"""
                INSERT INTO time_finding_cells
                WITH {cells}
                SELECT $run, $kind, key, op, rank, count(*), fsum(v), coalesce(var_pop(v), 0) * count(*),
                       fsum(step_us), coalesce(bool_or(v < $share * step_us), false), fsum(dur)
                FROM cells GROUP BY key, op, rank
                """,
                params,
            )
            c.execute(
                f"""
                INSERT INTO time_finding_keys (run_id, kind, key, op, n_steps, steps)
                WITH {cells}
                SELECT $run, $kind, key, op, count(DISTINCT step), list(DISTINCT step ORDER BY step)
                FROM cells GROUP BY key, op
                """,
                {"run": run_id, "kind": kind} | ({"mean": mean_step} if "$mean" in cells else {}),
            )
        # the instances each finding links (the largest skews first); the rank that caused most of a
        # collective's wait by arriving last
        c.execute(
            """
            UPDATE time_finding_keys k SET top_instances = s.ids FROM (
                SELECT t.group_key, list(i.instance_id ORDER BY i.skew_us DESC NULLS LAST, i.instance_id)[:$top] AS ids
                FROM time_stragglers t
                JOIN time_instances i ON i.run_id = t.run_id AND i.group_key = t.group_key AND i.last_rank = t.rank
                WHERE t.run_id = $run AND t.straggler GROUP BY t.group_key
            ) s
            WHERE k.run_id = $run AND k.kind = 'straggler' AND k.key = s.group_key
            """,
            {"run": run_id, "top": TOP_INSTANCES},
        )
        c.execute(
            """
            UPDATE time_finding_keys k
            SET instances = s.n, top_instances = s.ids, cause_rank = w.last_rank, cause_wait_us = w.w
            FROM (
                SELECT coalesce(scheme, 'unattributed') AS key, op, count(*) AS n,
                       list(instance_id ORDER BY skew_us DESC NULLS LAST, instance_id)[:$top] AS ids
                FROM time_instances WHERE run_id = $run GROUP BY ALL
            ) s LEFT JOIN (
                SELECT key, op, first(last_rank ORDER BY w DESC, last_rank) AS last_rank, max(w) AS w FROM (
                    SELECT coalesce(i.scheme, 'unattributed') AS key, i.op, i.last_rank, sum(m.wait_us) AS w
                    FROM time_instances i
                    JOIN time_instance_members m ON m.run_id = i.run_id AND m.instance_id = i.instance_id
                    WHERE i.run_id = $run AND m.wait_us IS NOT NULL GROUP BY ALL
                ) GROUP BY key, op
            ) w ON w.key = s.key AND w.op = s.op
            WHERE k.run_id = $run AND k.kind = 'wait_dominated' AND k.key = s.key AND k.op = s.op
            """,
            {"run": run_id, "top": TOP_INSTANCES},
        )

    transaction(con, write)


@dataclass(frozen=True)
class _Key:
    """One key's row of time_finding_keys besides its steps."""

    n_steps: int
    instances: int | None
    top_instances: list[int]
    cause_rank: int | None
    cause_wait_us: float | None


class _Inputs:
    """The run's timing-finding inputs, read once per request."""

    def __init__(self, con: duckdb.DuckDBPyConnection, run_id: int) -> None:
        self.con, self.run_id = con, run_id
        self.ranks: dict[tuple[str, str, str], dict[int, _Rank]] = {}
        self.dur: dict[tuple[str, str, str], float] = {}
        for kind, key, op, rank, n, value, m2, step, weak, dur in con.execute(
            """
            SELECT kind, key, op, rank, cells, value_us, m2_us2, step_us, weak, dur_us
            FROM time_finding_cells WHERE run_id = ? ORDER BY kind, key, op, rank
            """,
            [run_id],
        ).fetchall():
            self.ranks.setdefault((kind, key, op), {})[rank] = _Rank(n, value, m2, step or 0.0, weak)
            self.dur[(kind, key, op)] = self.dur.get((kind, key, op), 0.0) + (dur or 0.0)
        self.keys = {
            (kind, key, op): _Key(n, inst, list(top or []), cause, cause_w)
            for kind, key, op, n, inst, top, cause, cause_w in con.execute(
                """
                SELECT kind, key, op, n_steps, instances, top_instances, cause_rank, cause_wait_us
                FROM time_finding_keys WHERE run_id = ?
                """,
                [run_id],
            ).fetchall()
        }

    def of(self, kind: str) -> list[tuple[str, str]]:
        """The (key, op) pairs of a kind, in order."""
        return sorted({(key, op) for k, key, op in self.ranks if k == kind})

    def cells(self, kind: str, key: str, op: str = "") -> _Cells | None:
        ranks = self.ranks.get((kind, key, op))
        if not ranks:
            return None

        def steps() -> list[int]:
            row = self.con.execute(
                "SELECT steps FROM time_finding_keys WHERE run_id = ? AND kind = ? AND key = ? AND op = ?",
                [self.run_id, kind, key, op],
            ).fetchall()[0]
            return list(row[0])

        return _Cells(ranks, self.keys[(kind, key, op)].n_steps, steps)


_SUGGEST_EXPOSED = {
    "dp": "Overlap the gradient reduction with the backward: DDP/FSDP buckets that fill earlier (a smaller "
    "first bucket, bucket_cap_mb), no_sync during accumulation, and no host synchronisation (loss.item(), "
    "gradient clipping on the host) between backward and the optimizer step.",
    "tp": "Tensor-parallel collectives sit on the critical path by design: overlap them with the next GEMM "
    "(sequence parallelism with communication overlap, async tensor parallel), or keep the tp group inside "
    "a node so each call is short.",
    "pp": "Pipeline sends and receives exposed mean bubbles: more micro-batches per step, an interleaved "
    "schedule, or batched point-to-point (batch_isend_irecv) posted before the compute they feed.",
    "cp": "Overlap the ring exchange of KV blocks with attention on the block already here.",
    "ep": "Overlap the token dispatch with the shared-expert or attention compute, and balance the routing.",
}


def _timed(
    fid: str,
    title: str,
    cells: _Cells,
    evidence: dict[str, float | int | str | None],
    view: dict[str, str | int | None],
    suggestion: str,
    instances: list[int] | None = None,
) -> Finding | None:
    """A timing finding from per-(rank, step) costs (µs), or None below the threshold or on noise."""
    if not cells.ranks or _noise(cells) is not None:
        return None
    per_rank = cells.per_rank()
    share = cells.mean() / cells.mean_step()
    severity = _time_severity(share, cells.n_steps, len(per_rank))
    if severity is None:
        return None
    return Finding(
        id=fid,
        title=title.format(ms=_dur(cells.mean()), share=_pct(share)),
        severity=severity,
        impact=min(share, 1.0),
        evidence=evidence | {"ms_per_step": cells.mean() / 1e3, "step_share": share, "mean_step_us": cells.mean_step()},
        view=view,
        suggestion=suggestion,
        ms_per_step=cells.mean() / 1e3,
        step_share=share,
        stability=_stability(cells),
        instances=instances or [],
        steps=cells.steps(),
        ranks=sorted(per_rank),
    )


def _exposed(inputs: _Inputs) -> list[Finding]:
    out = []
    for scheme, _ in inputs.of("exposed"):
        cells, wait = inputs.cells("exposed", scheme), inputs.cells("wait", scheme)
        if cells is None or wait is None:
            continue
        waiting = wait.mean() / cells.mean() if cells.mean() else 0.0
        hint = (
            " Most of it is waiting for a late member: see the straggler and wait findings first."
            if waiting >= 0.5
            else ""
        )
        f = _timed(
            f"exposed-comm:{scheme}",
            f"{scheme}: {{ms}} of exposed communication per step ({{share}} of the step, no compute running)",
            cells,
            {"scheme": scheme, "wait_ms_per_step": wait.mean() / 1e3, "wait_share": waiting},
            {"page": "time", "scheme": scheme},
            _SUGGEST_EXPOSED.get(scheme, "Overlap these collectives with independent compute.") + hint,
        )
        if f is not None:
            out.append(f)
    return out


def _memcpy(con: duckdb.DuckDBPyConnection, run_id: int, inputs: _Inputs) -> list[Finding]:
    cells = inputs.cells("memcpy", "")
    if cells is None:
        return []
    (htod, htod_busy, dtoh, dtoh_busy) = con.execute(
        "SELECT htod_bytes, htod_busy_us, dtoh_bytes, dtoh_busy_us FROM time_finding_runs WHERE run_id = ?", [run_id]
    ).fetchall()[0]
    moved = {"htod": (htod or 0, htod_busy or 0.0), "dtoh": (dtoh or 0, dtoh_busy or 0.0)}
    n = cells.count()
    evidence: dict[str, float | int | str | None] = {}
    for d in ("htod", "dtoh"):
        b, busy = moved[d]
        evidence[f"{d}_bytes_per_step"] = int(b / n)
        evidence[f"{d}_gbps"] = b / (busy * 1e3) if busy else None
    f = _timed(
        "memcpy-exposed",
        "{ms} per step of memory copies that no compute overlaps ({share} of the step)",
        cells,
        evidence,
        {"page": "time"},
        "Copy asynchronously from pinned memory (non_blocking=True on a side stream) and prefetch the next "
        "batch during compute; for host-offloaded optimizers overlap the parameter and gradient transfers with "
        "the backward, or keep states on the device when memory allows.",
    )
    return [] if f is None else [f]


def _stragglers(
    con: duckdb.DuckDBPyConnection, run_id: int, inputs: _Inputs, mean_step_us: float | None
) -> list[Finding]:
    rows = con.execute(
        """
        SELECT group_key, coalesce(scheme, 'unattributed'), rank, arrived_last_share, steps_mostly_last, steps,
               imposed_us_per_step, instances
        FROM time_stragglers WHERE run_id = ? AND straggler ORDER BY group_key
        """,
        [run_id],
    ).fetchall()
    out = []
    for group, scheme, rank, last_share, mostly, n_steps, imposed, n_inst in rows:
        waited = inputs.cells("straggler", group)
        if waited is None or _noise(waited) is not None:
            continue
        share = waited.mean() / mean_step_us if mean_step_us else 0.0
        ranks = sorted({*waited.ranks, rank})
        severity = _time_severity(share, waited.n_steps, len(ranks)) or "low"
        out.append(
            Finding(
                id=f"straggler:{group}",
                title=f"Rank {rank} is a persistent {scheme} straggler: its peers wait {_dur(waited.mean())} per "
                f"step for it ({_pct(share)} of the step)",
                severity=severity,
                impact=min(share, 1.0),
                evidence={
                    "rank": rank,
                    "scheme": scheme,
                    "group": group,
                    "imposed_ms_per_step": imposed / 1e3,
                    "wait_ms_per_step": waited.mean() / 1e3,
                    "arrived_last_share": last_share,
                    "steps_mostly_last": mostly,
                    "steps": n_steps,
                    "instances": n_inst,
                },
                view={"page": "time", "scheme": scheme, "group": group, "rank": rank},
                suggestion=f"Rank {rank} reaches the {scheme} collectives last, by arrival, in most steps: look at "
                "what it does before them that its peers do not (data loading, a slower or throttled device, "
                "extra work on that rank such as logging or checkpointing, a noisy neighbour on its host).",
                ms_per_step=waited.mean() / 1e3,
                step_share=share,
                stability=f"caused most of the group's wait in {mostly} of {n_steps} steps; the others wait "
                + _stability(waited),
                instances=inputs.keys[("straggler", group, "")].top_instances,
                steps=waited.steps(),
                ranks=ranks,
            )
        )
    return out


def _wait_dominated(inputs: _Inputs) -> list[Finding]:
    """Collectives (per scheme and op) whose members spend most of their time in them waiting."""
    out = []
    for scheme, op in inputs.of("wait_dominated"):
        cells = inputs.cells("wait_dominated", scheme, op)
        dur = inputs.dur[("wait_dominated", scheme, op)]
        if cells is None or not dur:
            continue
        wait = fsum(x.value_us for x in cells.ranks.values())
        if wait / dur < WAIT_DOMINATES:
            continue
        key = inputs.keys[("wait_dominated", scheme, op)]
        f = _timed(
            f"wait-dominated:{scheme}:{op}",
            f"{scheme} {op}: {{ms}} per step waiting inside the collective ({{share}} of the step), "
            f"{_pct(wait / dur)} of its time",
            cells,
            {
                "scheme": scheme,
                "op": op,
                "wait_share_of_duration": wait / dur,
                "instances": key.instances,
                "wait_mostly_caused_by_rank": key.cause_rank,
                "caused_share": key.cause_wait_us / wait if key.cause_wait_us is not None and wait else None,
            },
            {"page": "time", "scheme": scheme, "op": op},
            "The collective itself is quick; its members wait for the last one to arrive. Find who arrives "
            "last (the straggler finding, the wait heatmap) and what delays it before this call; if no single "
            "rank does, the imbalance is in the work between calls (uneven shards, data loading, host syncs).",
            key.top_instances,
        )
        if f is not None:
            out.append(f)
    return out


def _time_findings(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[list[Finding], bool]:
    """The timing findings and whether the run has the arrival analysis (a straggler verdict per group)."""
    by_arrival = bool(con.execute("SELECT count(*) FROM time_stragglers WHERE run_id = ?", [run_id]).fetchall()[0][0])
    inputs = _Inputs(con, run_id)
    whole = inputs.cells("memcpy", "")  # every (rank, step) with a step time
    mean_step = whole.mean_step() if whole is not None else None
    found = _exposed(inputs) + _memcpy(con, run_id, inputs)
    if by_arrival and mean_step:
        found += _stragglers(con, run_id, inputs, mean_step) + _wait_dominated(inputs)
    return found, by_arrival


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
    steps = _steps(con, run_id)
    timed, by_arrival = _time_findings(con, run_id)
    views = _Views(con, run_id)
    out = (
        timed
        + _small_messages(con, run_id, bw, steps)
        + _imbalance(con, run_id, totals, steps, by_arrival, views)
        + _low_busbw(con, run_id, bw, steps, views)
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
        f.evidence_text = {k: _shown(k, v, f.evidence) for k, v in f.evidence.items() if v is not None}
    out.sort(key=lambda f: (SEVERITY_ORDER[f.severity], -(f.ms_per_step or 0.0), -f.impact, f.id))
    return out
