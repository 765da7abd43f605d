"""Bandwidth of measured calls: algbw = S / duration, busbw = algbw x the nccl-tests factor of the op
for its own group size (commlens.vocab.busbw_factor), GB = 1e9 B.

Only measured durations count: device kernel time, or the CPU op time of a gloo group (gloo runs the
collective inside the op). The CPU time of an NCCL call is only its enqueue and is never used.
Per op, the half-bandwidth size is the lower bound of the smallest size bin whose median busbw reaches
half of the op's best bin median; calls below it are latency-bound.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import duckdb
import pyarrow as pa

from commlens.vocab import busbw_factor

from .histograms import bin_index, bin_spec, registered
from .iterations import run_id_of
from .models import BandwidthReport, BinBandwidth, CallBandwidth, OpBandwidth, SchemeOpBandwidth

def measured_dur_sql(e: str = "e", g: str = "g") -> str:
    """SQL predicate: the event's duration is measured transfer time (kernel, or a gloo CPU op)."""
    return (f"({e}.dur_us > 0 AND ({e}.dur_source = 'kernel' OR ({e}.dur_source = 'cpu_op' "
            f"AND lower(coalesce({g}.backend, '')) NOT LIKE '%nccl%')))")


_CALLS_SQL = """
    SELECT e.rank, e.process, g.scheme, e.op, coalesce(e.group_size, g.size) AS n, e.msg_bytes, e.dur_us,
           e.dur_source, g.backend,
           CASE
             WHEN e.op = 'barrier' THEN 'barrier moves no payload'
             WHEN e.msg_bytes IS NULL THEN 'no message size'
             WHEN e.msg_bytes = 0 THEN 'zero-byte call'
             WHEN e.dur_us IS NULL OR e.dur_us <= 0 THEN 'no measured duration'
             WHEN e.dur_source = 'cpu_op' AND lower(coalesce(g.backend, '')) LIKE '%nccl%'
               THEN 'CPU enqueue time of an NCCL call is not its transfer time'
             WHEN coalesce(e.dur_source, '') NOT IN ('kernel', 'cpu_op') THEN 'duration of unknown origin'
             WHEN coalesce(e.group_size, g.size) IS NULL THEN 'group size unknown'
             WHEN coalesce(e.group_size, g.size) < 2 AND e.op NOT IN ('send', 'recv') THEN 'single-rank group'
           END AS excluded
    FROM comm_events e
    LEFT JOIN process_groups g ON g.run_id = e.run_id AND g.group_key = e.group_key
    WHERE e.run_id = ?
"""


@contextmanager
def measured_calls(con: duckdb.DuckDBPyConnection, run_id: int) -> Iterator[tuple[str, dict[str, int]]]:
    """SQL over the usable calls (rank, process, scheme, op, n, msg_bytes, dur_us, factor, k, algbw,
    busbw; one parameter: run_id) and the count of calls left out per reason."""
    excluded = dict(con.execute(
        f"SELECT excluded, count(*) FROM ({_CALLS_SQL}) c WHERE excluded IS NOT NULL GROUP BY 1", [run_id]
    ).fetchall())
    pairs = con.execute(
        f"SELECT DISTINCT op, n, msg_bytes FROM ({_CALLS_SQL}) c WHERE excluded IS NULL", [run_id]
    ).fetchall()
    factors = sorted({(op, n) for op, n, _ in pairs})
    sizes = sorted({size for _, _, size in pairs})
    factor_table = pa.table({
        "op": pa.array([op for op, _ in factors], pa.string()),
        "n": pa.array([n for _, n in factors], pa.int32()),
        "factor": pa.array([busbw_factor(op, n) for op, n in factors], pa.float64()),
    })
    size_table = pa.table({
        "msg_bytes": pa.array(sizes, pa.int64()),
        "k": pa.array([bin_index(size) for size in sizes], pa.int32()),
    })
    with registered(con, factor_table) as fname, registered(con, size_table) as sname:
        yield f"""
            SELECT c.rank, c.process, c.scheme, c.op, c.n, c.msg_bytes, c.dur_us, f.factor, s.k,
                   c.msg_bytes / c.dur_us / 1e3 AS algbw, c.msg_bytes / c.dur_us / 1e3 * f.factor AS busbw
            FROM ({_CALLS_SQL}) c
            JOIN {fname} f ON f.op = c.op AND f.n = c.n
            JOIN {sname} s ON s.msg_bytes = c.msg_bytes
            WHERE c.excluded IS NULL
        """, excluded


def bandwidth(con: duckdb.DuckDBPyConnection, run: str) -> BandwidthReport:
    """Per (op, size bin) medians of algbw and busbw, the half-bandwidth size per op, and per scheme."""
    run_id = run_id_of(con, run)
    with measured_calls(con, run_id) as (sql, excluded):
        bins = con.execute(
            f"""
            SELECT op, k, count(*), median(msg_bytes), median(dur_us), median(algbw), median(busbw),
                   list(DISTINCT n ORDER BY n)
            FROM ({sql}) m GROUP BY op, k ORDER BY op, k
            """,
            [run_id],
        ).fetchall()
        per_op_bins: dict[str, list[tuple]] = defaultdict(list)
        for row in bins:
            per_op_bins[row[0]].append(row)
        half: dict[str, int | None] = {}
        ops: list[OpBandwidth] = []
        for op, rows in per_op_bins.items():
            best = max(rows, key=lambda r: r[6])
            reach = next((r for r in rows if r[6] >= best[6] / 2), None)
            half_bytes = (1 << reach[1]) if reach is not None and best[6] > 0 else None
            half[op] = half_bytes
            below = con.execute(
                f"SELECT count(*), coalesce(sum(dur_us), 0) FROM ({sql}) m WHERE op = ? AND msg_bytes < ?",
                [run_id, op, half_bytes or 0],
            ).fetchall()[0]
            ops.append(OpBandwidth(
                op=op, calls=sum(r[2] for r in rows), best_busbw_gbps=best[6], best_bin=bin_spec(f"2^{best[1]}").label,
                half_bw_bytes=half_bytes, half_bw_label=bin_spec(f"2^{reach[1]}").label if half_bytes else None,
                latency_bound_calls=below[0], latency_bound_time_us=below[1],
            ))
        half_table = pa.table({"op": pa.array(list(half), pa.string()),
                               "half": pa.array([half[o] or 0 for o in half], pa.int64())})
        with registered(con, half_table) as hname:
            schemes = con.execute(
                f"""
                SELECT m.scheme, m.op, count(*), sum(m.dur_us), median(m.busbw),
                       count(*) FILTER (WHERE m.msg_bytes >= h.half),
                       median(m.busbw) FILTER (WHERE m.msg_bytes >= h.half)
                FROM ({sql}) m JOIN {hname} h ON h.op = m.op
                GROUP BY m.scheme, m.op ORDER BY m.scheme NULLS LAST, m.op
                """,
                [run_id],
            ).fetchall()
        total = sum(r[2] for r in bins)
    report_bins = [
        BinBandwidth(op=r[0], bin=bin_spec(f"2^{r[1]}"), calls=r[2], median_bytes=r[3], median_dur_us=r[4],
                     median_algbw_gbps=r[5], median_busbw_gbps=r[6], group_sizes=list(r[7]))
        for r in bins
    ]
    notes = []
    if not total:
        notes.append("no call has a measured duration (NCCL logs carry no time; traces need device kernels "
                     "or gloo CPU ops): no bandwidth")
    return BandwidthReport(
        run=run, calls_with_duration=total, excluded=excluded, bins=report_bins, ops=ops,
        by_scheme=[SchemeOpBandwidth(scheme=r[0], op=r[1], calls=r[2], time_us=r[3], median_busbw_gbps=r[4],
                                     large_calls=r[5], large_median_busbw_gbps=r[6]) for r in schemes],
        best_busbw_gbps=max((b.median_busbw_gbps for b in report_bins), default=None), notes=notes,
    )


def call_bandwidth(
    con: duckdb.DuckDBPyConnection, run: str, *, op: str | None = None, scheme: str | None = None,
    limit: int = 1000, offset: int = 0,
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
    return [CallBandwidth(rank=r[0], process=r[1], scheme=r[2], op=r[3], group_size=r[4], msg_bytes=r[5], dur_us=r[6],
                          algbw_gbps=r[7], busbw_gbps=r[8], busbw_factor=r[9]) for r in rows]
