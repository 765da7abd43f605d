"""Bandwidth of measured calls: algbw = S / duration, busbw = algbw x the nccl-tests factor of the op
for its own group size (commlens.vocab.busbw_factor), GB = 1e9 B.

Only measured durations count: device kernel time, or the CPU op time of a gloo group (gloo runs the
collective inside the op). The CPU time of an NCCL call is only its enqueue and is never used.
Per op, the half-bandwidth size is the lower bound of the smallest size bin whose median busbw reaches
half of the op's best bin median; calls below it reach less than half the best (the contract's
`latency_bound_*`: latency at small sizes, but at MiB sizes a measured kernel's time also holds its wait for
late peers and its contention with compute, so the report does not call them latency-bound). These summaries are computed when
a run's calls or groups change (commlens.store.aggregates: bw_bins, bw_ops, bw_schemes, bw_excluded);
the report reads them. Individual calls (call_bandwidth) are read from the calls themselves.
"""

from __future__ import annotations

import duckdb

from commlens.contract.analysis import (
    BandwidthReport,
    BinBandwidth,
    CallBandwidth,
    OpBandwidth,
    SchemeOpBandwidth,
    bin_spec,
)
from commlens.store.aggregates import measured_calls, measured_kind_sql

from .iterations import fresh_run_id, run_id_of

# commlens.store.aggregates.CALLS_SQL's reasons whose explanation depends on the kind of file
NO_DURATION = "no measured duration"
ENQUEUE_ONLY = "CPU enqueue time of an NCCL call is not its transfer time"
WHY = {
    "group size unknown": "the files name no process group for them and the run's world size is unknown, and busbw "
    "needs the group's size"
}


def _why_no_bandwidth(con: duckdb.DuckDBPyConnection, run_id: int, excluded: dict[str, int]) -> str:
    """The real reason a run has no bandwidth, from its own files: what left its calls out, and for calls
    without a duration what their kind of file lacks (an NCCL log has no durations; a trace's NCCL calls
    need their device kernels)."""
    kinds = {
        str(r[0])
        for r in con.execute(
            "SELECT DISTINCT kind FROM sources WHERE run_id = ? AND status = 'ok'", [run_id]
        ).fetchall()
    }
    widest = con.execute("SELECT max(group_size) FROM comm_events WHERE run_id = ? AND counted", [run_id]).fetchall()[
        0
    ][0]
    if widest == 1:
        lacking = (
            "every call is on a one-rank group, where NCCL moves no data between ranks and launches no "
            "kernel: bandwidth needs a group of two or more ranks"
        )
    elif kinds <= {"nccl_log", "run_config"}:
        lacking = "NCCL logs carry no durations; a profiler trace of the same ranks gives them"
    else:
        lacking = (
            "an NCCL call's CPU time is only its launch: the profiler must record CUDA activities so the trace "
            "holds its kernels; gloo calls are timed on the CPU"
        )
    parts = [
        f"{n} calls: {reason} ({lacking if reason in (NO_DURATION, ENQUEUE_ONLY) else WHY.get(reason, 'left out')})"
        for reason, n in excluded.items()
    ]
    if not parts and not _has_calls(con, run_id):
        return "no bandwidth: the run holds no collective or point-to-point call to measure"
    return "no bandwidth: " + ("; ".join(parts) if parts else f"no call has a measured duration ({lacking})")


def _world_taken(con: duckdb.DuckDBPyConnection, run_id: int) -> list[str]:
    """The note on measured calls that name no process group and no size: their busbw takes the default group's
    size, the run's world (commlens.store.aggregates.CALLS_SQL, as wire bytes and the time analysis take them)."""
    calls, world = con.execute(
        f"""SELECT sum(a.calls), any_value(r.world_size) FROM comm_agg a
            JOIN runs r ON r.run_id = a.run_id
            LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
            WHERE a.run_id = ? AND a.group_key IS NULL AND a.max_group_size IS NULL AND r.world_size >= 2
              AND a.msg_bytes > 0 AND a.op <> 'barrier' AND {measured_kind_sql()}""",
        [run_id],
    ).fetchall()[0]
    if not calls:
        return []
    return [
        f"{calls:,} measured call{'s' if calls != 1 else ''} name no process group: their busbw takes the default "
        f"group's {world} ranks (the run's world size), as the wire bytes and the time analysis do"
    ]


def _has_calls(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    return (
        con.execute("SELECT 1 FROM comm_events WHERE run_id = ? AND counted LIMIT 1", [run_id]).fetchone() is not None
    )


def bandwidth(con: duckdb.DuckDBPyConnection, run: str) -> BandwidthReport:
    """Per (op, size bin) medians of algbw and busbw, the half-bandwidth size per op, and per scheme.
    Read from the run's precomputed summaries (exact medians, computed when its calls or groups change)."""
    run_id = fresh_run_id(con, run)
    excluded = {
        r[0]: int(r[1])
        for r in con.execute(
            "SELECT reason, calls FROM bw_excluded WHERE run_id = ? ORDER BY reason", [run_id]
        ).fetchall()
    }
    bins = con.execute(
        """SELECT op, k, calls, median_bytes, median_dur_us, median_algbw_gbps, median_busbw_gbps, group_sizes
           FROM bw_bins WHERE run_id = ? ORDER BY op, k""",
        [run_id],
    ).fetchall()
    ops = [
        OpBandwidth(
            op=op,
            calls=calls,
            best_busbw_gbps=best,
            best_bin=bin_spec(f"2^{best_k}").label,
            half_bw_bytes=half_bytes,
            half_bw_label=bin_spec(f"2^{half_k}").label if half_bytes else None,
            latency_bound_calls=below_calls,
            latency_bound_time_us=below_time,
        )
        for op, calls, best_k, best, half_k, half_bytes, below_calls, below_time in con.execute(
            """SELECT op, calls, best_k, best_busbw_gbps, half_k, half_bw_bytes, latency_bound_calls,
                      latency_bound_time_us FROM bw_ops WHERE run_id = ? ORDER BY op""",
            [run_id],
        ).fetchall()
    ]
    schemes = con.execute(
        """SELECT scheme, op, calls, time_us, median_busbw_gbps, large_calls, large_median_busbw_gbps
           FROM bw_schemes WHERE run_id = ? ORDER BY scheme NULLS LAST, op""",
        [run_id],
    ).fetchall()
    total = sum(r[2] for r in bins)
    report_bins = [
        BinBandwidth(
            op=r[0],
            bin=bin_spec(f"2^{r[1]}"),
            calls=r[2],
            median_bytes=r[3],
            median_dur_us=r[4],
            median_algbw_gbps=r[5],
            median_busbw_gbps=r[6],
            group_sizes=list(r[7]),
        )
        for r in bins
    ]
    notes = [] if total else [_why_no_bandwidth(con, run_id, excluded)]
    notes += _world_taken(con, run_id)
    return BandwidthReport(
        run=run,
        calls_with_duration=total,
        excluded=excluded,
        bins=report_bins,
        ops=ops,
        by_scheme=[
            SchemeOpBandwidth(
                scheme=r[0],
                op=r[1],
                calls=r[2],
                time_us=r[3],
                median_busbw_gbps=r[4],
                large_calls=r[5],
                large_median_busbw_gbps=r[6],
            )
            for r in schemes
        ],
        best_busbw_gbps=max((b.median_busbw_gbps for b in report_bins), default=None),
        notes=notes,
    )


def call_bandwidth(
    con: duckdb.DuckDBPyConnection,
    run: str,
    *,
    op: str | None = None,
    scheme: str | None = None,
    limit: int = 1000,
    offset: int = 0,
) -> list[CallBandwidth]:
    """algbw and busbw of each measured call (paginated), largest messages first."""
    run_id = run_id_of(con, run)
    conds, params = [], []
    for column, value in (("op", op), ("scheme", scheme)):
        if value is not None:
            conds.append(f"{column} = ?")
            params.append(value)
    where = ("WHERE " + " AND ".join(conds)) if conds else ""
    with measured_calls(con, run_id) as (sql, _):
        rows = con.execute(
            f"""
            SELECT rank, process, scheme, op, n, msg_bytes, dur_us, algbw, busbw, factor FROM ({sql}) m {where}
            ORDER BY msg_bytes DESC, rank, dur_us LIMIT ? OFFSET ?
            """,
            [run_id, *params, int(limit), int(offset)],
        ).fetchall()
    return [
        CallBandwidth(
            rank=r[0],
            process=r[1],
            scheme=r[2],
            op=r[3],
            group_size=r[4],
            msg_bytes=r[5],
            dur_us=r[6],
            algbw_gbps=r[7],
            busbw_gbps=r[8],
            busbw_factor=r[9],
        )
        for r in rows
    ]
