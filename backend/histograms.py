"""Message-size histograms per scheme x op x dtype: power-of-two bins, weighted by calls or bytes,
normalised per rank per iteration when iterations are known.

Bin k holds [2^k, 2^(k+1)) bytes (1024 B is in the 1 KiB-2 KiB bin); zero-byte calls have their own
'0 B' bin and calls without a size an 'unknown size' bin. Normalisation divides each rank's calls by
that rank's iterations and averages over the ranks of the run (after the rank filter), so a scheme
used by half the ranks shows half a call per rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

import duckdb

from commlens.ingest.aggregates import rank_key_sql

from .iterations import fresh_run_id, iteration_info
from .models import BinSpec, Histogram, HistogramSeries

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB")
ZERO_KEY, UNKNOWN_KEY = "zero", "unknown"


def format_bytes(n: int) -> str:
    """Exact power-of-two sizes in binary units ('1 KiB'); others with up to 3 significant digits."""
    if n < 1024:
        return f"{n} B"
    unit = min((n.bit_length() - 1) // 10, len(_UNITS) - 1)
    value = n / (1 << (10 * unit))
    text = f"{value:.0f}" if value == int(value) else f"{value:.3g}"
    return f"{text} {_UNITS[unit]}"


def bin_index(msg_bytes: int | None) -> int | None:
    """k of the bin [2^k, 2^(k+1)) holding msg_bytes; None for zero or unknown sizes."""
    if msg_bytes is None or msg_bytes <= 0:
        return None
    return int(msg_bytes).bit_length() - 1


def bin_key(msg_bytes: int | None) -> str:
    if msg_bytes is None:
        return UNKNOWN_KEY
    if msg_bytes <= 0:
        return ZERO_KEY
    return f"2^{bin_index(msg_bytes)}"


def bin_spec(key: str) -> BinSpec:
    if key == ZERO_KEY:
        return BinSpec(key=key, label="0 B", k=None, lo=0, hi=1)
    if key == UNKNOWN_KEY:
        return BinSpec(key=key, label="unknown size")
    k = int(key[2:])
    lo, hi = 1 << k, 1 << (k + 1)
    return BinSpec(key=key, label=f"{format_bytes(lo)}-{format_bytes(hi)}", k=k, lo=lo, hi=hi)


def bin_axis(keys: set[str]) -> list[BinSpec]:
    """'0 B', then every power-of-two bin between the smallest and largest used one, then 'unknown size'."""
    ks = sorted(int(k[2:]) for k in keys if k.startswith("2^"))
    axis = [bin_spec(ZERO_KEY)] if ZERO_KEY in keys else []
    if ks:
        axis += [bin_spec(f"2^{k}") for k in range(ks[0], ks[-1] + 1)]
    if UNKNOWN_KEY in keys:
        axis.append(bin_spec(UNKNOWN_KEY))
    return axis


def _rows_sql(run_id: int, step: int | None, rank: int | None) -> tuple[str, list]:
    """SQL for (scheme, op, dtype, rank_key, msg_bytes, has_it, no_iteration_reason, no_group, calls) of
    a run within the scope filters (rank, iteration), and its parameters.

    Without an iteration filter the run's aggregates answer (comm_agg, a few thousand rows). One
    iteration reads the calls themselves: the profiler step of traces with steps (a WHERE on run_id
    and step), and the stored detected iteration of the calls of sources without steps."""
    if step is None:
        rank_cond = " AND a.rank = ?" if rank is not None else ""
        return f"""
            SELECT g.scheme, a.op, a.dtype, a.rank_key, a.msg_bytes, a.in_iteration AS has_it, a.no_iteration_reason,
                   a.group_key IS NULL AS no_group, sum(a.calls) AS calls
            FROM comm_agg a LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
            WHERE a.run_id = ?{rank_cond}
            GROUP BY ALL
        """, [run_id, *([rank] if rank is not None else [])]
    rank_cond = " AND e.rank = ?" if rank is not None else ""
    rank_params = [rank] if rank is not None else []
    return f"""
        WITH ev AS (
            SELECT e.group_key, e.op, e.dtype, {rank_key_sql()} AS rank_key, e.msg_bytes
            FROM comm_events e WHERE e.run_id = ? AND e.step = ?{rank_cond}
            UNION ALL
            SELECT e.group_key, e.op, e.dtype, {rank_key_sql()} AS rank_key, e.msg_bytes
            FROM comm_iterations d
            JOIN comm_events e ON e.run_id = d.run_id AND e.source_id = d.source_id
                 AND coalesce(e.process, cast(e.rank AS VARCHAR), '?') = d.process AND e.seq = d.seq
            WHERE d.run_id = ? AND d.iteration = ?{rank_cond}
        )
        SELECT g.scheme, ev.op, ev.dtype, ev.rank_key, ev.msg_bytes, true AS has_it, NULL AS no_iteration_reason,
               ev.group_key IS NULL AS no_group, count(*) AS calls
        FROM ev LEFT JOIN process_groups g ON g.run_id = ? AND g.group_key = ev.group_key
        GROUP BY ALL
    """, [run_id, step, *rank_params, run_id, step, *rank_params, run_id]


def histogram(
    con: duckdb.DuckDBPyConnection,
    run: str,
    *,
    scheme: str | None = None,
    op: str | None = None,
    dtype: str | None = None,
    rank: int | None = None,
    step: int | None = None,
    weight: Literal["calls", "bytes"] = "calls",
    normalize: bool = True,
) -> Histogram:
    """Message-size histogram of a run, one series per (scheme, op, dtype).

    `step` selects one iteration: the profiler step number for traces with steps, the detected
    iteration index (0-based) for logs. With `normalize`, values are per rank per iteration when
    iterations are known (calls outside complete iterations are left out and counted in `excluded`),
    else per rank."""
    if weight not in ("calls", "bytes"):
        raise ValueError(f"weight must be 'calls' or 'bytes', not {weight!r}")
    run_id = fresh_run_id(con, run)
    info = iteration_info(con, run, run_id)
    filters: dict[str, str | int | None] = {"scheme": scheme, "op": op, "dtype": dtype, "rank": rank, "step": step}
    # Scope filters (rank, iteration) choose the ranks averaged over; series filters choose the calls.
    sql, params = _rows_sql(run_id, step, rank)
    scoped = con.execute(sql, params).fetchall()
    all_ranks = {r[3] for r in scoped}
    rows = [r for r in scoped
            if (scheme is None or r[0] == scheme) and (op is None or r[1] == op) and (dtype is None or r[2] == dtype)]

    notes: list[str] = []
    iterations = info.iterations
    known = normalize and info.mode != "none"
    if not normalize:
        normalization = "none"
    elif known:
        normalization = "per_rank_per_iteration"
    else:
        normalization = "per_rank"
        notes.append("iterations unknown (no profiler steps, no repeating pattern): values are per rank, all calls")
    if known:
        # Only ranks with known iterations take part in a per-iteration average.
        all_ranks = {r for r in all_ranks if iterations.get(r)}
    n_ranks = len(all_ranks)

    excluded: dict[str, int] = defaultdict(int)
    cells: dict[tuple, dict[str, list[float]]] = {}
    unattributed = 0
    for sch, op_, dt, rk, size, has_it, reason, no_group, calls in rows:
        if no_group:
            unattributed += calls
        if known:
            iters = 1 if step is not None else iterations.get(rk)
            if not iters:
                excluded["rank without known iterations"] += calls
                continue
            if not has_it:
                excluded[reason or "no iteration"] += calls
                continue
            scale = 1.0 / iters / max(n_ranks, 1)
        elif normalization == "per_rank":
            scale = 1.0 / max(n_ranks, 1)
        else:
            scale = 1.0
        key = bin_key(size)
        cell = cells.setdefault((sch, op_, dt), {})
        c, b = cell.setdefault(key, [0.0, 0.0])
        cell[key] = [c + calls * scale, b + calls * (size or 0) * scale]

    axis = bin_axis({k for cell in cells.values() for k in cell})
    series = []
    for (sch, op_, dt), cell in sorted(cells.items(), key=lambda kv: tuple("" if x is None else str(x) for x in kv[0])):
        calls = [cell.get(b.key, [0.0, 0.0])[0] for b in axis]
        nbytes = [cell.get(b.key, [0.0, 0.0])[1] for b in axis]
        series.append(HistogramSeries(
            scheme=sch, op=op_, dtype=dt, calls=calls, bytes=nbytes,
            values=calls if weight == "calls" else nbytes, total_calls=sum(calls), total_bytes=sum(nbytes),
        ))
    if unattributed:
        notes.append(f"{unattributed} calls have no process group, so no scheme (series with scheme null)")
    return Histogram(
        run=run, weight=weight, normalization=normalization, filters=filters, n_ranks=n_ranks,
        iterations=info, bins=axis, series=series, excluded=dict(excluded),
        unattributed_events=unattributed, notes=notes,
    )
