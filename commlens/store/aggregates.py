"""Per-run aggregates of the store's calls, computed once when a run's data or attribution changes,
so analyses answer from a few thousand rows instead of rescanning every call on every request.

Tables (commlens/store/aggregates.sql, documented in docs/store.md): `agg_runs` (freshness and iteration mode),
`agg_sources`, `agg_iterations`, `comm_periods`, `process_iterations`, `comm_iterations` (the detected
iteration of each call of a source without profiler steps), `comm_agg` (calls per rank key, group,
op, dtype, size, iteration membership and duration kind) and the bandwidth summaries `bw_excluded`,
`bw_bins`, `bw_ops`, `bw_schemes` (exact medians, recomputed when groups change).

When: `refresh_run` at the end of ingest (`commlens.service.ingest.finalize_run`) recomputes everything;
`refresh_if_stale` (after scheme attribution and overrides, and on read through `ensure_fresh`)
compares fingerprints of the run's sources and process groups with those stored in `agg_runs` and
recomputes what changed: everything when sources changed; the bandwidth summaries when a group's
backend or size (which decide what counts as measured, and the busbw factor) or the set of groups
changed; only the per-scheme bandwidth medians (`bw_schemes`) when only schemes changed. Scheme is a
group property, so `comm_agg` (keyed by group_key) stays valid across attribution changes; readers
join process_groups at query time.

While an ingest job of the API is queued or running on a run, reads serve the aggregates of the last
refresh (the job's own refresh comes at its end), so polling clients do not recompute a growing run.

Only this module writes these tables; the SQL here is the definition of what counts as a measured
duration and why a call has no bandwidth (backend.bandwidth builds its report from it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from commlens.ingest.arrow_views import all_registered, registered
from commlens.ingest.periods import MIN_COVERAGE, find_period_tokens
from commlens.vocab import busbw_factor

from .jobs import active_jobs
from .tables import AGG_TABLES
from .transaction import transaction

_BW_TABLES = ("bw_excluded", "bw_bins", "bw_ops", "bw_schemes")
# Two connections refreshing one run conflict (or collide on agg_runs' key): the later one tries again.
_RETRY_ON = (duckdb.TransactionException, duckdb.ConstraintException)
_CONFLICT_RETRIES = 3


class AggregatesError(Exception):
    """The aggregates of a run cannot be brought up to date (read-only store)."""


def rank_key_sql(alias: str = "e") -> str:
    """SQL for the rank identity of an event: its global rank, else its process."""
    return f"coalesce(cast({alias}.rank AS VARCHAR), {alias}.process, '?')"


def measured_dur_sql(e: str = "e", g: str = "g") -> str:
    """SQL predicate: the event's duration is measured transfer time (kernel, or a gloo CPU op)."""
    return (
        f"({e}.dur_us > 0 AND ({e}.dur_source = 'kernel' OR ({e}.dur_source = 'cpu_op' "
        f"AND lower(coalesce({g}.backend, '')) NOT LIKE '%nccl%')))"
    )


def measured_kind_sql(a: str = "a", g: str = "g") -> str:
    """The same predicate over a comm_agg row (its dur_kind) and its group."""
    return (
        f"({a}.dur_kind = 'kernel' OR ({a}.dur_kind = 'cpu_op' AND lower(coalesce({g}.backend, '')) NOT LIKE '%nccl%'))"
    )


# ------------------------------------------------------------------------------ bandwidth SQL

# A call naming no group and no size is the default group's, the world (as wire bytes and the time analysis take it).
CALLS_SQL = """
    SELECT e.rank, e.process, g.scheme, e.op, coalesce(e.group_size, g.size, CASE WHEN e.group_key IS NULL THEN r.world_size END) AS n, e.msg_bytes, e.dur_us,
           e.dur_source, g.backend,
           CASE
             WHEN e.op = 'barrier' THEN 'barrier moves no payload'
             WHEN e.msg_bytes IS NULL THEN 'no message size'
             WHEN e.msg_bytes = 0 THEN 'zero-byte call'
             WHEN e.dur_us IS NULL OR e.dur_us <= 0 THEN 'no measured duration'
             WHEN e.dur_source = 'cpu_op' AND lower(coalesce(g.backend, '')) LIKE '%nccl%'
               THEN 'CPU enqueue time of an NCCL call is not its transfer time'
             WHEN coalesce(e.dur_source, '') NOT IN ('kernel', 'cpu_op') THEN 'duration of unknown origin'
             WHEN coalesce(e.group_size, g.size, CASE WHEN e.group_key IS NULL THEN r.world_size END) IS NULL THEN 'group size unknown'
             WHEN coalesce(e.group_size, g.size, CASE WHEN e.group_key IS NULL THEN r.world_size END) < 2 AND e.op NOT IN ('send', 'recv') THEN 'single-rank group'
           END AS excluded
    FROM comm_events e
    JOIN runs r ON r.run_id = e.run_id
    LEFT JOIN process_groups g ON g.run_id = e.run_id AND g.group_key = e.group_key
    WHERE e.run_id = ? AND e.counted
"""


def _bin_index(msg_bytes: int) -> int:
    return int(msg_bytes).bit_length() - 1


@contextmanager
def measured_calls(con: duckdb.DuckDBPyConnection, run_id: int) -> Iterator[tuple[str, dict[str, int]]]:
    """SQL over the usable calls (rank, process, scheme, op, n, msg_bytes, dur_us, factor, k, algbw,
    busbw; one parameter: run_id) and the count of calls left out per reason."""
    excluded: dict[str, int] = {}
    pairs: list[tuple[str, int, int]] = []
    for reason, op, n, size, calls in con.execute(
        f"""
        SELECT excluded, CASE WHEN excluded IS NULL THEN op END, CASE WHEN excluded IS NULL THEN n END,
               CASE WHEN excluded IS NULL THEN msg_bytes END, count(*)
        FROM ({CALLS_SQL}) c GROUP BY ALL
        """,
        [run_id],
    ).fetchall():
        if reason is None:
            pairs.append((op, n, size))
        else:
            excluded[reason] = excluded.get(reason, 0) + calls
    factors = sorted({(op, n) for op, n, _ in pairs})
    sizes = sorted({size for _, _, size in pairs})
    factor_table = pa.table(
        {
            "op": pa.array([op for op, _ in factors], pa.string()),
            "n": pa.array([n for _, n in factors], pa.int32()),
            "factor": pa.array([busbw_factor(op, n) for op, n in factors], pa.float64()),
        }
    )
    size_table = pa.table(
        {
            "msg_bytes": pa.array(sizes, pa.int64()),
            "k": pa.array([_bin_index(size) for size in sizes], pa.int32()),
        }
    )
    with registered(con, factor_table) as fname, registered(con, size_table) as sname:
        yield (
            f"""
            SELECT c.rank, c.process, c.scheme, c.op, c.n, c.msg_bytes, c.dur_us, f.factor, s.k,
                   c.msg_bytes / c.dur_us / 1e3 AS algbw, c.msg_bytes / c.dur_us / 1e3 * f.factor AS busbw
            FROM ({CALLS_SQL}) c
            JOIN {fname} f ON f.op = c.op AND f.n = c.n
            JOIN {sname} s ON s.msg_bytes = c.msg_bytes
            WHERE c.excluded IS NULL
        """,
            excluded,
        )


# ----------------------------------------------------------------------------- fingerprints


# The version of the rules the aggregates are computed by, part of the sources fingerprint: a store refreshed by
# older rules is stale, so its runs are recomputed once (2: calls naming no group take the world's size for
# busbw; BANDWIDTH_BOUND_FLOOR).
RULES = 2


def fingerprints(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[str, str]:
    """(sources, groups) fingerprints of a run: the rules' version and its ok sources (append-only), and its
    process groups' fields the aggregates depend on: "count:backend and size:scheme". Both are small tables."""
    src = con.execute(
        "SELECT count(*), coalesce(max(source_id), 0), coalesce(sum(source_id), 0) FROM sources "
        "WHERE run_id = ? AND status = 'ok'",
        [run_id],
    ).fetchall()[0]
    grp = con.execute(
        """
        SELECT count(*),
               coalesce(md5(string_agg(concat_ws('|', group_key, coalesce(backend, '-'),
                        coalesce(cast(size AS VARCHAR), '-')), chr(10) ORDER BY group_key)), ''),
               coalesce(md5(string_agg(concat_ws('|', group_key, coalesce(scheme, '-')), chr(10)
                                       ORDER BY group_key)), '')
        FROM process_groups WHERE run_id = ?
        """,
        [run_id],
    ).fetchall()[0]
    return f"rules{RULES}:{src[0]}:{src[1]}:{src[2]}", f"{grp[0]}:{grp[1]}:{grp[2]}"


def _stale(stored: tuple[str, str] | None, now: tuple[str, str]) -> str | None:
    """What to recompute: 'full' (sources changed), 'groups' (a group's backend or size, or the group
    set), 'schemes' (only schemes: the per-scheme bandwidth medians), or None (fresh)."""
    if stored is None or stored[0] != now[0]:
        return "full"
    if stored[1] == now[1]:
        return None
    return "schemes" if stored[1].rsplit(":", 1)[0] == now[1].rsplit(":", 1)[0] else "groups"


def stored_fingerprints(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[str, str] | None:
    rows = con.execute("SELECT sources_fp, groups_fp FROM agg_runs WHERE run_id = ?", [run_id]).fetchall()
    return (rows[0][0], rows[0][1]) if rows else None


# ----------------------------------------------------------------------------------- refresh


def refresh_run(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Recompute every aggregate of the run (after its calls were written or linked)."""
    transaction(con, lambda c: _refresh(c, run_id, "full"), _CONFLICT_RETRIES, _RETRY_ON)


def refresh_if_stale(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    """Recompute what changed since the last refresh (see the module docstring); True when it did."""

    def body(c: duckdb.DuckDBPyConnection) -> bool:
        now = fingerprints(c, run_id)
        level = _stale(stored_fingerprints(c, run_id), now)
        if level is None:
            return False
        _refresh(c, run_id, level, now)
        return True

    return transaction(con, body, _CONFLICT_RETRIES, _RETRY_ON)


def refresh_all(con: duckdb.DuckDBPyConnection) -> int:
    """Bring every run's aggregates up to date (an upgraded store); the number of runs refreshed."""
    return sum(refresh_if_stale(con, r[0]) for r in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall())


def is_fresh(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    """Whether the run's aggregates match its sources and groups now."""
    stored = stored_fingerprints(con, run_id)
    return stored is not None and stored == fingerprints(con, run_id)


def ensure_fresh(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Called by analyses before they read: refresh a stale run unless an ingest job is still writing it."""
    if is_fresh(con, run_id):
        return
    if active_jobs(con, run_id):
        return  # the job refreshes at its end; meanwhile serve the last aggregates
    try:
        refresh_if_stale(con, run_id)
    except (duckdb.TransactionException, duckdb.ConstraintException):
        return  # another connection is refreshing the same run; serve what is committed
    except duckdb.InvalidInputException as exc:
        if "read-only" in str(exc) or "read only" in str(exc):
            raise AggregatesError(
                "the aggregates of this run are out of date and the store is open read-only; open it once for "
                "writing (commlens ingest, commlens serve) to refresh them"
            ) from None
        raise


def _refresh(con: duckdb.DuckDBPyConnection, run_id: int, level: str, fps: tuple[str, str] | None = None) -> None:
    # Deleting the run's agg_runs row first makes two concurrent refreshes of one run conflict early.
    con.execute("DELETE FROM agg_runs WHERE run_id = ?", [run_id])
    fps = fps or fingerprints(con, run_id)
    tables = {"full": AGG_TABLES[:-1], "groups": _BW_TABLES, "schemes": ("bw_schemes",)}[level]
    for table in tables:
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])  # fixed names
    if level == "full":
        _refresh_calls(con, run_id)
    if level in ("full", "groups"):
        _refresh_bandwidth(con, run_id)
    _refresh_bw_schemes(con, run_id)
    con.execute(
        """
        INSERT INTO agg_runs (run_id, sources_fp, groups_fp, calls, has_steps, has_detected)
        SELECT ?, ?, ?, coalesce(sum(calls), 0), coalesce(bool_or(has_steps), false),
               (SELECT count(*) > 0 FROM process_iterations WHERE run_id = ? AND iterations > 0)
        FROM agg_sources WHERE run_id = ?
        """,
        [run_id, fps[0], fps[1], run_id, run_id],
    )


def _refresh_calls(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    """agg_sources, detected periods and iterations, comm_agg, agg_iterations; True when some process
    of a source without profiler steps has a detected period."""
    con.execute(
        f"""
        INSERT INTO agg_sources (run_id, source_id, rank_key, has_steps, iterations, calls)
        WITH ev AS (
            SELECT e.source_id, min({rank_key_sql()}) AS rank_key, bool_or(e.step IS NOT NULL) AS has_steps,
                   count(DISTINCT e.step) AS n_steps, count(*) AS calls
            FROM comm_events e WHERE e.run_id = ? AND e.counted GROUP BY e.source_id
        ), st AS (
            SELECT source_id, count(DISTINCT step) AS n FROM steps WHERE run_id = ? GROUP BY source_id
        )
        SELECT ?, ev.source_id, ev.rank_key, ev.has_steps,
               CASE WHEN ev.has_steps THEN greatest(coalesce(st.n, 0), ev.n_steps) END, ev.calls
        FROM ev LEFT JOIN st USING (source_id)
        """,
        [run_id, run_id, run_id],
    )
    has_detected, ranges = _refresh_periods(con, run_id)
    if ranges is None:  # each call's own comm_iterations row
        detected = """LEFT JOIN comm_iterations d ON d.run_id = e.run_id AND d.source_id = e.source_id
             AND d.process = coalesce(e.process, cast(e.rank AS VARCHAR), '?') AND d.seq = e.seq"""
        iteration = "d.iteration IS NOT NULL"
    else:  # the same rows as a few seq ranges per communicator (see _iteration_ranges)
        detected = """LEFT JOIN _commlens_ranges d ON d.source_id = e.source_id
             AND d.process = coalesce(e.process, cast(e.rank AS VARCHAR), '?')
             AND d.comm IS NOT DISTINCT FROM coalesce(e.group_key, 'ptr:' || e.comm_ptr)
             AND e.seq BETWEEN d.lo AND d.hi"""
        iteration = "coalesce(d.in_iteration, false)"
    with all_registered(con, {} if ranges is None else {"_commlens_ranges": ranges}):
        con.execute(
            f"""
            INSERT INTO comm_agg (run_id, rank_key, rank, group_key, op, dtype, msg_bytes, in_iteration,
                                  no_iteration_reason, dur_kind, calls, sum_dur_us, min_dur_us, max_dur_us,
                                  max_group_size, first_row)
            SELECT e.run_id, {rank_key_sql()}, e.rank, e.group_key, e.op, e.dtype, e.msg_bytes,
                   CASE WHEN s.has_steps THEN e.step IS NOT NULL ELSE {iteration} END,
                   CASE WHEN s.has_steps THEN CASE WHEN e.step IS NULL THEN 'outside profiler steps' END
                        ELSE d.reason END,
                   CASE WHEN e.dur_us > 0 AND e.dur_source IN ('kernel', 'cpu_op') THEN e.dur_source END,
                   count(*), sum(e.dur_us), min(e.dur_us), max(e.dur_us), max(e.group_size), min(e.rowid)
            FROM comm_events e
            JOIN agg_sources s ON s.run_id = e.run_id AND s.source_id = e.source_id
            {detected}
            WHERE e.run_id = ? AND e.counted
            GROUP BY ALL
            """,
            [run_id],
        )
    # Iterations per rank key: profiler steps of the sources with steps, plus detected iterations.
    iterations: dict[str, int] = {
        rk: int(n)
        for rk, n in con.execute(
            "SELECT rank_key, sum(iterations) FROM agg_sources WHERE run_id = ? AND has_steps GROUP BY rank_key",
            [run_id],
        ).fetchall()
        if n
    }
    for _source_id, process, rank, it in con.execute(
        "SELECT source_id, process, rank, iterations FROM process_iterations WHERE run_id = ? ORDER BY ord", [run_id]
    ).fetchall():
        if it:
            rk = str(rank) if rank is not None else process
            iterations[rk] = iterations.get(rk, 0) + it
    if iterations:
        con.executemany(
            "INSERT INTO agg_iterations (run_id, rank_key, iterations) VALUES (?, ?, ?)",
            [[run_id, rk, n] for rk, n in iterations.items()],
        )
    return has_detected


# The calls of the sources without profiler steps, per communicator (source, process, comm), with its calls'
# (op, msg_bytes) numbered as tokens: equal pairs get equal tokens. The few distinct pairs are numbered and
# joined back (a window over every call would sort them all).
_PERIOD_CALLS = """
    WITH ev AS (
        SELECT e.source_id, coalesce(e.process, cast(e.rank AS VARCHAR), '?') AS process, e.rank,
               coalesce(e.group_key, 'ptr:' || e.comm_ptr) AS comm, e.group_key, e.seq, e.op, e.msg_bytes
        FROM comm_events e
        JOIN agg_sources s ON s.run_id = e.run_id AND s.source_id = e.source_id AND NOT s.has_steps
        WHERE e.run_id = ? AND e.counted AND e.source_id BETWEEN ? AND ?
    ), kinds AS (
        SELECT op, msg_bytes, row_number() OVER () AS tok FROM (SELECT DISTINCT op, msg_bytes FROM ev)
    )
    SELECT source_id, process, comm, any_value(group_key) AS group_key, max(rank) AS rank, {lists}
    FROM ev JOIN kinds ON kinds.op = ev.op AND kinds.msg_bytes IS NOT DISTINCT FROM ev.msg_bytes
    GROUP BY source_id, process, comm
    ORDER BY source_id, process, comm
"""
_TOK_BITS = 20  # a call packed as seq * 2^20 + token: seq within +-2^42, fewer than 2^20 distinct pairs
_SEQ_LIMIT = 1 << 42
# Calls whose periods are found at once (about 300 bytes each while they are: the refresh of 2 M calls in 8
# sources peaked at 708 MB all at once, 370 MB in batches of 500 k, 308 MB a source at a time, from 117 MB): the
# sources of a run are taken in batches of about this many calls, so the refresh's memory is bounded by the
# largest source, not by the run.
PERIOD_BATCH_CALLS = 500_000


def _source_batches(con: duckdb.DuckDBPyConnection, run_id: int) -> list[tuple[int, int]]:
    """The run's sources without profiler steps as ranges of source ids, in order, each holding about
    PERIOD_BATCH_CALLS calls (a larger source alone)."""
    batches: list[tuple[int, int]] = []
    total = 0
    for source_id, calls in con.execute(
        """SELECT e.source_id, count(*) FROM comm_events e
           JOIN agg_sources s ON s.run_id = e.run_id AND s.source_id = e.source_id AND NOT s.has_steps
           WHERE e.run_id = ? AND e.counted GROUP BY e.source_id ORDER BY e.source_id""",
        [run_id],
    ).fetchall():
        if batches and total + calls <= PERIOD_BATCH_CALLS:
            batches[-1] = (batches[-1][0], source_id)
            total += calls
        else:
            batches.append((source_id, source_id))
            total = calls
    return batches


def _period_calls(con: duckdb.DuckDBPyConnection, run_id: int, sources: tuple[int, int]) -> pa.Table:
    """One row per communicator of the sources with ids in `sources` (ordered as comm_periods.ord) with its
    calls' tokens and seqs in seq order (`toks`, `seqs`). Each call goes into one list as seq and token packed
    in an integer, unordered, and each list is sorted with numpy (DuckDB's two ordered lists sorted every call
    twice); a seq that does not fit (or is NULL), or too many tokens, and the lists are ordered by DuckDB
    instead."""
    table = con.sql(
        _PERIOD_CALLS.format(
            lists=f"""list(CASE WHEN seq BETWEEN -{_SEQ_LIMIT} AND {_SEQ_LIMIT} THEN seq * {1 << _TOK_BITS} + tok END)
                   AS packed, count(*) FILTER (WHERE seq IS NULL OR seq NOT BETWEEN -{_SEQ_LIMIT} AND {_SEQ_LIMIT})
                   AS unfit, max(tok) AS toks"""
        ),
        params=[run_id, *sources],
    ).to_arrow_table()
    if pc.max(table["unfit"]).as_py() or (pc.max(table["toks"]).as_py() or 0) >= 1 << _TOK_BITS:
        lists = "list(tok ORDER BY seq) AS toks, list(seq ORDER BY seq) AS seqs"
        return con.sql(_PERIOD_CALLS.format(lists=lists), params=[run_id, *sources]).to_arrow_table()
    packed = table["packed"].combine_chunks()
    offsets = packed.offsets
    values = packed.values.to_numpy().copy()
    bounds = offsets.to_numpy()
    for i in range(len(bounds) - 1):
        values[bounds[i] : bounds[i + 1]].sort()
    table = table.drop_columns(["packed", "unfit", "toks"])
    toks = pa.ListArray.from_arrays(offsets, pa.array(values & ((1 << _TOK_BITS) - 1)))
    return table.append_column("toks", toks).append_column(
        "seqs", pa.ListArray.from_arrays(offsets, values >> _TOK_BITS)
    )


def _refresh_periods(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[bool, pa.Table | None]:
    """Period detection for every communicator of the sources without profiler steps (see
    backend.iterations for the rules), stored in comm_periods and process_iterations, and the
    detected iteration of each of their calls in comm_iterations. Whether a process has a detected
    period, and the same rows as seq ranges (`_iteration_ranges`; None where they cannot stand for them).
    A batch of sources at a time (`_source_batches`): every rule is within a source's processes."""
    detected, parts, ords = False, [], (0, 0)
    for sources in _source_batches(con, run_id):
        has, ranges, ords = _refresh_batch(con, run_id, _period_calls(con, run_id, sources), ords)
        detected |= has
        parts.append(ranges)
    if not parts:
        return False, _iteration_ranges(pa.table({}), [], [], {})
    if any(p is None for p in parts):
        return detected, None
    return detected, pa.concat_tables(p for p in parts if p is not None)


def _refresh_batch(
    con: duckdb.DuckDBPyConnection, run_id: int, table: pa.Table, ords: tuple[int, int]
) -> tuple[bool, pa.Table | None, tuple[int, int]]:
    """_refresh_periods for the communicators of one batch of sources (`table`, from _period_calls); `ords`:
    the comm_periods and process_iterations rows written before it, which number this batch's on."""
    if not table.num_rows:
        return False, _iteration_ranges(table, [], [], {}), ords
    toks = table["toks"].combine_chunks()
    offsets = toks.offsets.to_numpy()
    values = toks.values.to_numpy()
    keys = zip(table["source_id"].to_pylist(), table["process"].to_pylist(), table["comm"].to_pylist(), strict=True)
    comms: dict[tuple[Any, ...], dict[str, Any]] = {
        key: {
            "group_key": group_key,
            "calls": int(offsets[i + 1] - offsets[i]),
            "period": find_period_tokens(values[offsets[i] : offsets[i + 1]]),
        }
        for i, (key, group_key) in enumerate(zip(keys, table["group_key"].to_pylist(), strict=True))
    }
    ranks: dict[tuple[int, str], int | None] = {}  # a process's rank (one per process; NULL when unmapped)
    for key, rank in zip(comms, table["rank"].to_pylist(), strict=False):
        if rank is not None or key[:2] not in ranks:
            ranks[key[:2]] = rank
    proc_iters: dict[tuple[int, str], int | None] = {}
    share: dict[tuple[int, str], list[int]] = {}  # [calls in communicators with a period, all calls]
    for key, c in comms.items():
        p = c["period"]
        proc = key[:2]
        sh = share.setdefault(proc, [0, 0])
        sh[1] += c["calls"]
        if p is not None:
            sh[0] += c["calls"]
            prev = proc_iters.get(proc)
            proc_iters[proc] = p.repeats if prev is None else min(prev, p.repeats)
        else:
            proc_iters.setdefault(proc, None)
    for proc, (with_period, total) in share.items():
        if with_period < MIN_COVERAGE * total:
            proc_iters[proc] = None  # a small repeating communicator does not define the process's iterations
    con.executemany(
        """INSERT INTO comm_periods (run_id, source_id, process, comm, group_key, ord, calls, period,
                                   offset_calls, repeats)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        [
            [
                run_id,
                key[0],
                key[1],
                key[2],
                c["group_key"],
                ords[0] + i,
                c["calls"],
                p.period if p else None,
                p.offset if p else None,
                p.repeats if p else None,
            ]
            for i, (key, c) in enumerate(comms.items())
            for p in [c["period"]]
        ],
    )
    con.executemany(
        "INSERT INTO process_iterations (run_id, source_id, process, rank, iterations, ord) VALUES (?, ?, ?, ?, ?, ?)",
        [
            [run_id, s, p, ranks.get((s, p)), it, ords[1] + i]
            for i, ((s, p), it) in enumerate(sorted(proc_iters.items()))
        ],
    )
    periods = [c["period"] for c in comms.values()]
    iters = [proc_iters.get(key[:2]) or 0 for key in comms]
    _insert_iterations(con, run_id, table, periods, proc_iters)
    ranges = _iteration_ranges(table, periods, iters, proc_iters)
    return any(proc_iters.values()), ranges, (ords[0] + len(comms), ords[1] + len(proc_iters))


# Why a call has no detected iteration (comm_iterations.reason), by the first rule that applies.
_NO_ITERATION = (
    "no repeating pattern in its process",
    "communicator without a repeating pattern",
    "before the repeating pattern (setup)",
    "after the last complete iteration",
)


def _insert_iterations(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    table: pa.Table,
    periods: list[Any],
    proc_iters: dict[tuple[int, str], int | None],
) -> None:
    """comm_iterations from the communicators' calls in seq order (`table`, as `_refresh_periods` reads it):
    a call's iteration is its position in its communicator against the period, counted in numpy columns
    from the few per-communicator numbers (a window over every call in SQL sorted them all again)."""
    seqs = table["seqs"].combine_chunks()
    offsets = seqs.offsets.to_numpy()
    counts = np.diff(offsets)
    process = table["process"].to_pylist()
    iters = np.array(
        [proc_iters.get((s, p)) or 0 for s, p in zip(table["source_id"].to_pylist(), process, strict=True)], np.int64
    )
    has_period = np.array([p is not None for p in periods], bool)
    period = np.array([p.period if p else 1 for p in periods], np.int64)
    first = np.array([p.offset if p else 0 for p in periods], np.int64)
    # calls per iteration of the process: the period's repeats shared out over the process's iterations
    span = np.where(
        has_period & (iters > 0),
        period * (np.array([p.repeats if p else 1 for p in periods]) // np.maximum(iters, 1)),
        1,
    )
    idx = np.arange(offsets[-1] - offsets[0], dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], counts)
    each = [np.repeat(a, counts) for a in (iters, has_period, first, span)]
    c_iters, c_period, c_first, c_span = each
    counted = c_period & (c_iters > 0) & (idx >= c_first)
    it = np.where(counted, (idx - c_first) // c_span, -1)
    reason = np.select([c_iters == 0, ~c_period, idx < c_first, it >= c_iters], [0, 1, 2, 3], default=-1).astype(
        np.int32
    )
    process_codes = np.repeat(np.arange(len(process), dtype=np.int32), counts)
    rows = pa.table(
        {
            "source_id": pa.array(np.repeat(table["source_id"].to_numpy(), counts), pa.int32()),
            "process": pa.DictionaryArray.from_arrays(pa.array(process_codes), pa.array(process, pa.string())),
            "seq": seqs.flatten(),
            "iteration": pa.array(it, pa.int32(), mask=reason >= 0),
            "reason": pa.DictionaryArray.from_arrays(
                pa.array(reason, mask=reason < 0), pa.array(_NO_ITERATION, pa.string())
            ),
        }
    )
    with registered(con, rows) as name:
        con.execute(
            f"INSERT INTO comm_iterations (run_id, source_id, process, seq, iteration, reason) "
            f"SELECT ?, source_id, process, seq, iteration, reason FROM {name}",
            [run_id],
        )


def _iteration_ranges(
    table: pa.Table, periods: list[Any], iters: list[int], proc_iters: dict[tuple[int, str], int | None]
) -> pa.Table | None:
    """comm_iterations' membership and reason as seq ranges: a communicator's calls in seq order fall into
    at most three runs of positions (before the pattern, in complete iterations, after the last one), or
    one (no pattern), so comm_agg joins each call to a few rows per communicator instead of to its own
    row. Equal to the row join when (source, process, seq) names one call: else (or with a NULL seq) None."""
    names = ["source_id", "process", "comm", "lo", "hi", "in_iteration", "reason"]
    if not table.num_rows:
        return pa.table({n: pa.array([], t) for n, t in zip(names, _RANGE_TYPES, strict=True)})
    seqs = table["seqs"].combine_chunks()
    if seqs.values.null_count:
        return None
    offsets = seqs.offsets.to_numpy()
    values = seqs.values.to_numpy()
    sources, processes, comm = (table[c].to_pylist() for c in ("source_id", "process", "comm"))
    per_process: dict[tuple[int, str], list[int]] = {}
    for i, key in enumerate(zip(sources, processes, strict=True)):
        per_process.setdefault(key, []).append(i)
    for rows in per_process.values():
        seq = np.concatenate([values[offsets[i] : offsets[i + 1]] for i in rows])
        lo, hi = int(seq.min()), int(seq.max())
        if hi - lo < 4 * len(seq) + 64:
            if np.bincount(seq - lo).max() > 1:
                return None
        elif len(np.unique(seq)) < len(seq):
            return None
    out: list[tuple[Any, ...]] = []
    for i, (p, n_iters) in enumerate(zip(periods, iters, strict=True)):
        start, n = int(offsets[i]), int(offsets[i + 1] - offsets[i])
        if not n_iters:
            pieces = [(0, n, 0)]
        elif p is None:
            pieces = [(0, n, 1)]
        else:
            span = p.period * (p.repeats // max(n_iters, 1))
            a = min(p.offset, n)
            b = max(a, min(p.offset + n_iters * span, n))
            pieces = [(0, a, 2), (a, b, -1), (b, n, 3)]
        for lo_pos, hi_pos, reason in pieces:
            if hi_pos > lo_pos:
                out.append(
                    (
                        sources[i],
                        processes[i],
                        comm[i],
                        int(values[start + lo_pos]),
                        int(values[start + hi_pos - 1]),
                        reason < 0,
                        _NO_ITERATION[reason] if reason >= 0 else None,
                    )
                )
    return pa.table(
        {n: pa.array([r[k] for r in out], t) for k, (n, t) in enumerate(zip(names, _RANGE_TYPES, strict=True))}
    )


_RANGE_TYPES = (pa.int32(), pa.string(), pa.string(), pa.int64(), pa.int64(), pa.bool_(), pa.string())


# bw_bins' medians and the measured column each is of. An exact median holds every value of its group until the
# group is done (DuckDB does not spill it to disk): one query per median needs memory for one column of the run's
# measured calls, where the four together needed four (a 100 M-call run failed its refresh within 6 GB).
_BIN_MEDIANS = {
    "median_bytes": "msg_bytes",
    "median_dur_us": "dur_us",
    "median_algbw_gbps": "algbw",
    "median_busbw_gbps": "busbw",
}


def _insert_bins(con: duckdb.DuckDBPyConnection, run_id: int, sql: str) -> None:
    """bw_bins of the run: calls, group sizes and the exact medians per (op, size bin) of the measured calls `sql`."""
    first, *others = _BIN_MEDIANS.items()
    bins = {
        (op, k): {"calls": calls, "group_sizes": sorted(sizes), first[0]: median}
        for op, k, calls, sizes, median in con.execute(
            f"SELECT op, k, count(*), list(DISTINCT n), median({first[1]}) FROM ({sql}) m GROUP BY op, k", [run_id]
        ).fetchall()
    }
    if not bins:
        return  # no measured call: the other medians would scan the run for nothing
    for column, value in others:  # fixed names
        for op, k, median in con.execute(
            f"SELECT op, k, median({value}) FROM ({sql}) m GROUP BY op, k", [run_id]
        ).fetchall():
            bins[(op, k)][column] = median
    con.executemany(
        f"""INSERT INTO bw_bins (run_id, op, k, calls, group_sizes, {", ".join(_BIN_MEDIANS)})
            VALUES (?, ?, ?, ?, ?, {", ".join("?" * len(_BIN_MEDIANS))})""",
        [[run_id, op, k, b["calls"], b["group_sizes"], *(b[c] for c in _BIN_MEDIANS)] for (op, k), b in bins.items()],
    )


def _refresh_bandwidth(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Exact medians of algbw and busbw per (op, size bin) and per (scheme, op), the half-bandwidth
    size per op and the calls below it (backend.bandwidth states the rules)."""
    with measured_calls(con, run_id) as (sql, excluded):
        if excluded:
            con.executemany(
                "INSERT INTO bw_excluded (run_id, reason, calls) VALUES (?, ?, ?)",
                [[run_id, reason, n] for reason, n in excluded.items()],
            )
        _insert_bins(con, run_id, sql)
        bins = con.execute(
            "SELECT op, k, calls, median_busbw_gbps FROM bw_bins WHERE run_id = ? ORDER BY op, k", [run_id]
        ).fetchall()
        per_op: dict[str, list[tuple[Any, ...]]] = {}
        for row in bins:
            per_op.setdefault(row[0], []).append(row)
        ops: dict[str, list[Any]] = {}
        for op, rows in per_op.items():
            best = max(rows, key=lambda r: r[3])
            reach = next((r for r in rows if r[3] >= best[3] / 2), None)
            half_k = reach[1] if reach is not None and best[3] > 0 else None
            half_bytes = (1 << half_k) if half_k is not None else None
            ops[op] = [op, sum(r[2] for r in rows), best[1], best[3], half_k, half_bytes]
        half_table = pa.table(
            {"op": pa.array(list(ops), pa.string()), "half": pa.array([ops[o][5] or 0 for o in ops], pa.int64())}
        )
        with registered(con, half_table) as hname:
            below = {
                op: (n, t)
                for op, n, t in con.execute(
                    f"""
                SELECT m.op, count(*), coalesce(sum(m.dur_us), 0) FROM ({sql}) m JOIN {hname} h ON h.op = m.op
                WHERE m.msg_bytes < h.half GROUP BY m.op
                """,
                    [run_id],
                ).fetchall()
            }
        if ops:
            con.executemany(
                """INSERT INTO bw_ops (run_id, op, calls, best_k, best_busbw_gbps, half_k, half_bw_bytes,
                                       latency_bound_calls, latency_bound_time_us)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                [[run_id, *row, *below.get(op, (0, 0.0))] for op, row in ops.items()],
            )


# Smallest message counted as bandwidth-bound, whatever a run's curve says: in the alpha-beta model busbw reaches
# half its peak at S = alpha x B, well above 64 KiB for NCCL over NVLink or InfiniBand (a few us x tens of GB/s),
# so a curve whose half point is below it never left the latency-bound range (its best is noise among tiny calls).
BANDWIDTH_BOUND_FLOOR = 64 * 1024


def _refresh_bw_schemes(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Bandwidth per (scheme, op), the only summary that depends on schemes: medians over the measured
    calls, and over those at or above the op's half-bandwidth size (bw_ops) and BANDWIDTH_BOUND_FLOOR."""
    factors = sorted(
        {
            (op, n)
            for op, sizes in con.execute("SELECT op, group_sizes FROM bw_bins WHERE run_id = ?", [run_id]).fetchall()
            for n in sizes
        }
    )
    if not factors:
        return
    factor_table = pa.table(
        {
            "op": pa.array([op for op, _ in factors], pa.string()),
            "n": pa.array([n for _, n in factors], pa.int32()),
            "factor": pa.array([busbw_factor(op, n) for op, n in factors], pa.float64()),
        }
    )
    with registered(con, factor_table) as fname:
        measured = f"""
            WITH h AS (
                SELECT op, greatest(coalesce(half_bw_bytes, 0), {BANDWIDTH_BOUND_FLOOR}) AS half
                FROM bw_ops WHERE run_id = ?
            ),
            m AS (
                SELECT c.scheme, c.op, c.msg_bytes, c.dur_us, c.msg_bytes / c.dur_us / 1e3 * f.factor AS busbw
                FROM ({CALLS_SQL}) c JOIN {fname} f ON f.op = c.op AND f.n = c.n
                WHERE c.excluded IS NULL
            )
        """
        con.execute(
            f"""
            INSERT INTO bw_schemes (run_id, scheme, op, calls, time_us, median_busbw_gbps, large_calls)
            {measured}
            SELECT ?, m.scheme, m.op, count(*), sum(m.dur_us), median(m.busbw),
                   count(*) FILTER (WHERE m.msg_bytes >= h.half)
            FROM m JOIN h ON h.op = m.op
            GROUP BY m.scheme, m.op
            """,
            [run_id, run_id, run_id],
        )
        # the second median in its own query, as in _insert_bins: one column of the measured calls in memory
        con.execute(
            f"""
            UPDATE bw_schemes SET large_median_busbw_gbps = x.median
            FROM ({measured}
                  SELECT m.scheme, m.op, median(m.busbw) AS median FROM m JOIN h ON h.op = m.op
                  WHERE m.msg_bytes >= h.half GROUP BY m.scheme, m.op) x
            WHERE bw_schemes.run_id = ? AND bw_schemes.op = x.op AND bw_schemes.scheme IS NOT DISTINCT FROM x.scheme
            """,
            [run_id, run_id, run_id],
        )
