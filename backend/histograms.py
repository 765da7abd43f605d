"""Message-size histograms per scheme x op x dtype: power-of-two bins, weighted by calls or bytes,
normalised per rank per iteration when iterations are known for every rank (else per rank over all calls,
so no rank's calls are dropped).

Bin k holds [2^k, 2^(k+1)) bytes (1024 B is in the 1 KiB-2 KiB bin); zero-byte calls have their own
'0 B' bin and calls without a size an 'unknown size' bin. Normalisation divides each rank's calls by
that rank's iterations and averages over the ranks of the run (after the rank filter), so a scheme
used by half the ranks shows half a call per rank.

`bar_calls` lists the calls one bar counts, with the same scope (scope_calls_sql), bins and
normalisation rule (iterations_only), so a bar and its list of calls cannot disagree.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal

import duckdb

from commlens.contract.analysis import (
    NO_DTYPE,
    UNATTRIBUTED,
    UNKNOWN_KEY,
    ZERO_KEY,
    BarCall,
    BarCalls,
    BinSpec,
    Histogram,
    HistogramSeries,
    IterationInfo,
    bin_spec,
)
from commlens.store.aggregates import rank_key_sql

from .iterations import fresh_run_id, iteration_info
from .ranks import process_keys, processes_note


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


def bin_axis(keys: set[str]) -> list[BinSpec]:
    """'0 B', then every power-of-two bin between the smallest and largest used one, then 'unknown size'."""
    ks = sorted(int(k[2:]) for k in keys if k.startswith("2^"))
    axis = [bin_spec(ZERO_KEY)] if ZERO_KEY in keys else []
    if ks:
        axis += [bin_spec(f"2^{k}") for k in range(ks[0], ks[-1] + 1)]
    if UNKNOWN_KEY in keys:
        axis.append(bin_spec(UNKNOWN_KEY))
    return axis


_DETECTED_JOIN = (
    "e.run_id = d.run_id AND e.source_id = d.source_id "
    "AND coalesce(e.process, cast(e.rank AS VARCHAR), '?') = d.process AND e.seq = d.seq"
)


def scope_calls_sql(select: str, run_id: int, step: int | None, rank: int | None) -> tuple[str, list[Any]]:
    """SQL selecting `select` (columns of comm_events e) and `iteration` for the calls of a run within
    the scope filters (rank, iteration), and its parameters. Only counted calls (store.md: an NCCL log's
    calls of a rank that a profiler trace also describes count there).

    A call's iteration is its profiler step for traces with steps, else its detected iteration (0-based,
    comm_iterations; NULL outside complete iterations). With `step`, only the calls of that iteration:
    a WHERE on run_id and step, and the stored detected iteration of the calls of sources without steps
    (disjoint: a source with steps has no detected iterations)."""
    rank_cond = " AND e.rank = ?" if rank is not None else ""
    rank_params = [rank] if rank is not None else []
    if step is None:
        return (
            f"""
            SELECT {select}, coalesce(e.step, d.iteration) AS iteration
            FROM comm_events e LEFT JOIN comm_iterations d ON {_DETECTED_JOIN}
            WHERE e.run_id = ? AND e.counted{rank_cond}""",
            [run_id, *rank_params],
        )
    return (
        f"""
            SELECT {select}, e.step AS iteration FROM comm_events e
            WHERE e.run_id = ? AND e.counted AND e.step = ?{rank_cond}
            UNION ALL
            SELECT {select}, d.iteration FROM comm_iterations d JOIN comm_events e ON {_DETECTED_JOIN}
            WHERE d.run_id = ? AND e.counted AND d.iteration = ?{rank_cond}""",
        [run_id, step, *rank_params, run_id, step, *rank_params],
    )


def _rows_sql(run_id: int, step: int | None, rank: int | None) -> tuple[str, list]:
    """SQL for (scheme, op, dtype, rank_key, msg_bytes, has_it, no_iteration_reason, no_group, calls) of
    a run within the scope filters (rank, iteration), and its parameters.

    Without an iteration filter the run's aggregates answer (comm_agg, a few thousand rows). One
    iteration reads the calls themselves (scope_calls_sql)."""
    if step is None:
        rank_cond = " AND a.rank = ?" if rank is not None else ""
        return (
            f"""
            SELECT g.scheme, a.op, a.dtype, a.rank_key, a.msg_bytes, a.in_iteration AS has_it, a.no_iteration_reason,
                   a.group_key IS NULL AS no_group, sum(a.calls) AS calls
            FROM comm_agg a LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
            WHERE a.run_id = ?{rank_cond}
            GROUP BY ALL
        """,
            [run_id, *([rank] if rank is not None else [])],
        )
    scope, params = scope_calls_sql(
        f"e.group_key, e.op, e.dtype, {rank_key_sql()} AS rank_key, e.msg_bytes", run_id, step, rank
    )
    return (
        f"""
        WITH ev AS ({scope})
        SELECT g.scheme, ev.op, ev.dtype, ev.rank_key, ev.msg_bytes, true AS has_it, NULL AS no_iteration_reason,
               ev.group_key IS NULL AS no_group, count(*) AS calls
        FROM ev LEFT JOIN process_groups g ON g.run_id = ? AND g.group_key = ev.group_key
        GROUP BY ALL
    """,
        [*params, run_id],
    )


def iterations_only(info: IterationInfo, normalize: bool, rank_keys: set[str] | None) -> bool:
    """Whether a histogram counts only the calls inside complete iterations: normalised, with iterations
    known for every rank in scope (`rank_keys`; None when one iteration is selected). Where some rank has
    no known iterations the histogram is per rank over all calls, so no rank's calls are dropped."""
    if not normalize or info.mode == "none":
        return False
    return rank_keys is None or all(info.iterations.get(k) for k in rank_keys)


def _scope_rank_keys(con: duckdb.DuckDBPyConnection, run_id: int, rank: int | None) -> set[str]:
    """The ranks (rank keys) with calls in the run, or the one rank of the rank filter."""
    rows = con.execute(
        "SELECT DISTINCT rank_key FROM comm_agg WHERE run_id = ?" + (" AND rank = ?" if rank is not None else ""),
        [run_id, *([rank] if rank is not None else [])],
    ).fetchall()
    return {str(r[0]) for r in rows}


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
    iterations are known for every rank in scope (calls outside complete iterations are left out and
    counted in `excluded`), else per rank over all calls (a note says what per iteration would leave out)."""
    if weight not in ("calls", "bytes"):
        raise ValueError(f"weight must be 'calls' or 'bytes', not {weight!r}")
    run_id = fresh_run_id(con, run)
    info = iteration_info(con, run, run_id)
    filters: dict[str, str | int | None] = {"scheme": scheme, "op": op, "dtype": dtype, "rank": rank, "step": step}
    # Scope filters (rank, iteration) choose the ranks averaged over; series filters choose the calls.
    sql, params = _rows_sql(run_id, step, rank)
    scoped = con.execute(sql, params).fetchall()
    all_ranks = {r[3] for r in scoped}
    wanted = None if scheme == UNATTRIBUTED else scheme  # 'unattributed': the series with scheme null, as /calls
    rows = [
        r
        for r in scoped
        if (scheme is None or r[0] == wanted) and (op is None or r[1] == op) and (dtype is None or r[2] == dtype)
    ]

    notes: list[str] = []
    iterations = info.iterations
    known = iterations_only(info, normalize, None if step is not None else all_ranks)
    normalization: Literal["per_rank_per_iteration", "per_rank", "none"]
    if not normalize:
        normalization = "none"
    elif known:
        normalization = "per_rank_per_iteration"
    elif info.mode == "none":
        normalization = "per_rank"
        notes.append("iterations unknown (no profiler steps, no repeating pattern): values are per rank, all calls")
    else:
        normalization = "per_rank"
        without = sorted(r for r in all_ranks if not iterations.get(r))
        left = sum(r[8] for r in scoped if r[3] in without)
        notes.append(
            f"iterations are known for {len(all_ranks) - len(without)} of {len(all_ranks)} ranks: values are per "
            f"rank over all calls, so the {left} calls of ranks without iterations count too "
            "(per iteration would leave them out)"
        )
    if known:
        # Only ranks with known iterations take part in a per-iteration average.
        all_ranks = {r for r in all_ranks if iterations.get(r)}
    n_ranks = len(all_ranks)
    n_processes = len(all_ranks & process_keys(con, run_id))
    if note := processes_note(n_processes, n_ranks, "ranks averaged over"):
        notes.append(note)

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
        series.append(
            HistogramSeries(
                scheme=sch,
                op=op_,
                dtype=dt,
                calls=calls,
                bytes=nbytes,
                values=calls if weight == "calls" else nbytes,
                total_calls=sum(calls),
                total_bytes=sum(nbytes),
            )
        )
    if unattributed:
        notes.append(f"{unattributed} calls have no process group, so no scheme (series with scheme null)")
    return Histogram(
        run=run,
        weight=weight,
        normalization=normalization,
        filters=filters,
        n_ranks=n_ranks,
        n_processes=n_processes,
        iterations=info,
        bins=axis,
        series=series,
        excluded=dict(excluded),
        unattributed_events=unattributed,
        notes=notes,
    )


# ------------------------------------------------------------------------------- a bar's calls


def _bin_condition(spec: BinSpec) -> tuple[str, list[Any]]:
    """SQL over ev.msg_bytes for membership of a bin, the same partition as bin_key."""
    if spec.key == UNKNOWN_KEY:
        return "ev.msg_bytes IS NULL", []
    if spec.key == ZERO_KEY:
        return "ev.msg_bytes <= 0", []
    return "ev.msg_bytes > 0 AND (ev.msg_bytes >> ?) = 1", [spec.k]


def bar_calls(
    con: duckdb.DuckDBPyConnection,
    run: str,
    *,
    bin: str | None = None,
    scheme: str | None = None,
    op: str | None = None,
    dtype: str | None = None,
    rank: int | None = None,
    step: int | None = None,
    normalize: bool = True,
    limit: int = 100,
    offset: int = 0,
) -> BarCalls:
    """The calls one bar of `histogram(con, run, ...)` counts, in file, rank and time order.

    Same arguments as the histogram (scope: rank and step, the profiler step or detected iteration; series:
    scheme, op, dtype) plus the bar's `bin` key (None: every size). `scheme='unattributed'` selects the calls without a
    scheme, `dtype='unknown'` those without a dtype (the series with scheme or dtype null). With
    `normalize` and known iterations, only calls inside complete iterations, as the normalised bar counts;
    then `total` is the bar's value times ranks and iterations, else it is the bar's raw count."""
    spec = bin_spec(bin) if bin is not None else None
    run_id = fresh_run_id(con, run)
    scope_ranks = None if step is not None else _scope_rank_keys(con, run_id, rank)
    only_iterations = iterations_only(iteration_info(con, run, run_id), normalize, scope_ranks)
    scope, params = scope_calls_sql(
        "e.rank, e.process, e.seq, e.op, e.dtype, e.msg_bytes, e.elems_in, e.elems_out, e.group_size, e.group_key, "
        "e.peer, e.step, e.ts_us, e.dur_us, e.source_id",
        run_id,
        step,
        rank,
    )
    conds, cond_params = _bin_condition(spec) if spec is not None else ("true", [])
    conditions, params = [conds], [*params, run_id, *cond_params]
    if scheme == UNATTRIBUTED:
        conditions.append("g.scheme IS NULL")
    elif scheme is not None:
        conditions.append("g.scheme = ?")
        params.append(scheme)
    if op is not None:
        conditions.append("ev.op = ?")
        params.append(op)
    if dtype == NO_DTYPE:
        conditions.append("ev.dtype IS NULL")
    elif dtype is not None:
        conditions.append("ev.dtype = ?")
        params.append(dtype)
    if only_iterations:
        conditions.append("ev.iteration IS NOT NULL")
    body = f"""
        WITH ev AS ({scope})
        SELECT r.name AS run, ev.rank, ev.op, ev.dtype, ev.msg_bytes, ev.elems_in, ev.elems_out, ev.group_size,
               ev.group_key, g.scheme, ev.peer, ev.step, ev.iteration, ev.ts_us, ev.dur_us, s.kind AS source_kind,
               s.path AS file, ev.process, ev.seq
        FROM ev JOIN sources s ON s.source_id = ev.source_id JOIN runs r ON r.run_id = s.run_id
        LEFT JOIN process_groups g ON g.run_id = ? AND g.group_key = ev.group_key
        WHERE {" AND ".join(conditions)}"""
    total = con.execute(f"SELECT count(*) FROM ({body})", params).fetchall()[0][0]
    result = con.execute(
        f"{body} ORDER BY file, rank NULLS LAST, ts_us NULLS LAST, process, seq LIMIT ? OFFSET ?",
        [*params, limit, offset],
    )
    names = [d[0] for d in result.description]
    items = [BarCall(**dict(zip(names, row, strict=True))) for row in result.fetchall()]
    return BarCalls(
        bin=spec,
        iterations_only=only_iterations,
        items=items,
        total=total,
        limit=limit,
        offset=offset,
        next_offset=offset + limit if offset + limit < total else None,
    )
