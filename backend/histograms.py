"""Message-size histograms per scheme x op x dtype: power-of-two bins, weighted by calls or bytes,
normalised per rank per iteration when iterations are known.

Bin k holds [2^k, 2^(k+1)) bytes (1024 B is in the 1 KiB-2 KiB bin); zero-byte calls have their own
'0 B' bin and calls without a size an 'unknown size' bin. Normalisation divides each rank's calls by
that rank's iterations and averages over the ranks of the run (after the rank filter), so a scheme
used by half the ranks shows half a call per rank.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Literal

import duckdb

from .iterations import Iterations, assign_iterations, rank_key_sql, run_id_of
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


@contextmanager
def registered(con: duckdb.DuckDBPyConnection, table) -> Iterator[str]:
    """Register an Arrow table under a fresh name for the duration of a query."""
    name = f"_commlens_{uuid.uuid4().hex[:12]}"
    con.register(name, table)
    try:
        yield name
    finally:
        con.unregister(name)


def event_rows_sql(detected: str) -> str:
    """Events of a run with scheme, rank key and iteration (step for traces with steps, else the
    detected iteration), plus why an event has no iteration. Parameters: run_id, run_id."""
    return f"""
        WITH stepped AS (SELECT DISTINCT source_id FROM comm_events WHERE run_id = ? AND step IS NOT NULL)
        SELECT e.source_id, e.process, e.seq, e.rank, {rank_key_sql()} AS rank_key, e.op, e.dtype, e.msg_bytes,
               e.group_key, e.group_size, e.peer, e.dur_us, e.dur_source, g.scheme, g.backend, g.size AS pg_size,
               CASE WHEN st.source_id IS NOT NULL THEN e.step ELSE d.iteration END AS iteration,
               CASE WHEN st.source_id IS NOT NULL THEN
                        CASE WHEN e.step IS NULL THEN 'outside profiler steps' END
                    ELSE d.reason END AS no_iteration_reason
        FROM comm_events e
        LEFT JOIN process_groups g ON g.run_id = e.run_id AND g.group_key = e.group_key
        LEFT JOIN stepped st ON st.source_id = e.source_id
        LEFT JOIN {detected} d ON d.source_id = e.source_id AND d.process IS NOT DISTINCT FROM
             coalesce(e.process, cast(e.rank AS VARCHAR), '?') AND d.seq = e.seq
        WHERE e.run_id = ?
    """


def _where(conditions: list[tuple[str, object]]) -> str:
    """WHERE clause over fixed column names; the values go in as parameters."""
    return ("WHERE " + " AND ".join(f"{column} = ?" for column, _ in conditions)) if conditions else ""


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
    run_id = run_id_of(con, run)
    its: Iterations = assign_iterations(con, run)
    filters: dict[str, str | int | None] = {"scheme": scheme, "op": op, "dtype": dtype, "rank": rank, "step": step}
    # Scope filters choose the ranks (and iteration) averaged over; series filters choose the calls.
    scope = [(c, v) for c, v in (("rank", rank), ("iteration", step)) if v is not None]
    select = scope + [(c, v) for c, v in (("scheme", scheme), ("op", op), ("dtype", dtype)) if v is not None]
    with registered(con, its.detected) as detected:
        base = event_rows_sql(detected)
        rows = con.execute(
            f"""
            SELECT scheme, op, dtype, rank_key, msg_bytes, iteration IS NOT NULL AS has_it, no_iteration_reason,
                   group_key IS NULL AS no_group, count(*) AS calls
            FROM ({base}) ev {_where(select)}
            GROUP BY ALL
            """,
            [run_id, run_id, *[v for _, v in select]],
        ).fetchall()
        all_ranks = {
            r[0] for r in con.execute(
                f"SELECT DISTINCT rank_key FROM ({base}) ev {_where(scope)}", [run_id, run_id, *[v for _, v in scope]]
            ).fetchall()
        }

    notes: list[str] = []
    iterations = its.info.iterations
    known = normalize and its.info.mode != "none"
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
        iterations=its.info, bins=axis, series=series, excluded=dict(excluded),
        unattributed_events=unattributed, notes=notes,
    )
