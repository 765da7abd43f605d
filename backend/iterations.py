"""Iterations of a run: profiler steps where the trace has them, else the repeating period of each
communicator's (op, msg_bytes) sequence (NCCL logs carry no step markers).

Period detection. For one communicator in one process the calls form a sequence s[0..n). A period p
covers the longest tail of s in which s[i] == s[i + p]; with r = s reversed that tail has length
p + Z_r[p] (Z-function), so every p is scored in O(n). The chosen period maximises the covered tail
(smallest p on ties); it must repeat at least twice and cover at least half of the calls, otherwise no
period is reported. Calls before the tail are setup (offset). A process has iterations only when the
communicators with a period hold at least half of its calls. The shortest repeating unit can be one
micro-batch rather than one optimizer step, so a process's iteration count is the smallest number of
complete repeats among its communicators, and each communicator reports how many units it runs per
iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import pyarrow as pa

from .models import CommPeriod, IterationInfo, PeriodReport, ProcessIterations

MIN_REPEATS = 2
MIN_COVERAGE = 0.5


class UnknownRunError(LookupError):
    """The run name is not in the store."""


def run_id_of(con: duckdb.DuckDBPyConnection, run: str) -> int:
    # fetchall, not fetchone: DuckDB refuses register() while a result is only partly fetched.
    rows = con.execute("SELECT run_id FROM runs WHERE name = ?", [run]).fetchall()
    if not rows:
        raise UnknownRunError(f"no run named {run!r} in this store")
    return rows[0][0]


def z_function(seq: list[int]) -> list[int]:
    """Z[i] = length of the longest common prefix of seq and seq[i:] (Z[0] = len(seq))."""
    n = len(seq)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and seq[z[i]] == seq[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    return z


@dataclass(frozen=True)
class Period:
    period: int
    offset: int  # first call of the repeating part
    repeats: int  # complete repeats from offset


def find_period(seq: list) -> Period | None:
    """The repeating unit of a sequence of hashable items, or None (see the module docstring)."""
    n = len(seq)
    if n < MIN_REPEATS:
        return None
    ids: dict = {}
    rev = [ids.setdefault(x, len(ids)) for x in reversed(seq)]
    z = z_function(rev)
    best_p, best_cov = 0, 0
    for p in range(1, n // MIN_REPEATS + 1):
        cov = min(n, p + z[p])
        if cov // p >= MIN_REPEATS and cov > best_cov:
            best_p, best_cov = p, cov
    if not best_p or best_cov < MIN_COVERAGE * n:
        return None
    return Period(best_p, n - best_cov, best_cov // best_p)


@dataclass
class _Comm:
    source_id: int
    process: str
    comm: str | None
    group_key: str | None
    seqs: list[int]
    items: list[tuple[str, int | None]]
    period: Period | None = None


ProcKey = tuple[int, str]  # (source_id, process)


def _detect(
    con: duckdb.DuckDBPyConnection, run_id: int
) -> tuple[list[_Comm], dict[ProcKey, int | None], dict[ProcKey, int | None]]:
    """Periods of every communicator of the sources that have no profiler steps."""
    rows = con.execute(
        """
        SELECT e.source_id, coalesce(e.process, cast(e.rank AS VARCHAR), '?') AS process, e.rank,
               coalesce(e.group_key, 'ptr:' || e.comm_ptr) AS comm, e.group_key, e.seq, e.op, e.msg_bytes
        FROM comm_events e
        WHERE e.run_id = ? AND e.source_id NOT IN (
            SELECT DISTINCT source_id FROM comm_events WHERE run_id = ? AND step IS NOT NULL)
        ORDER BY e.source_id, process, comm, e.seq
        """,
        [run_id, run_id],
    ).fetchall()
    comms: dict[tuple[int, str, str | None], _Comm] = {}
    ranks: dict[tuple[int, str], int | None] = {}
    for source_id, process, rank, comm, group_key, seq, op, msg_bytes in rows:
        c = comms.get((source_id, process, comm))
        if c is None:
            c = comms[(source_id, process, comm)] = _Comm(source_id, process, comm, group_key, [], [])
        c.seqs.append(seq)
        c.items.append((op, msg_bytes))
        if rank is not None or (source_id, process) not in ranks:
            ranks[(source_id, process)] = rank if rank is not None else ranks.get((source_id, process))
    iterations: dict[tuple[int, str], int | None] = {}
    periodic: dict[tuple[int, str], list[int]] = {}  # [calls in communicators with a period, all calls]
    for c in comms.values():
        c.period = find_period(c.items)
        key = (c.source_id, c.process)
        share = periodic.setdefault(key, [0, 0])
        share[1] += len(c.items)
        if c.period is not None:
            share[0] += len(c.items)
            prev = iterations.get(key)
            iterations[key] = c.period.repeats if prev is None else min(prev, c.period.repeats)
        else:
            iterations.setdefault(key, None)
    for key, (with_period, total) in periodic.items():
        if with_period < MIN_COVERAGE * total:
            iterations[key] = None  # a small repeating communicator does not define the process's iterations
    return list(comms.values()), iterations, ranks


def detect_period(con: duckdb.DuckDBPyConnection, run: str) -> PeriodReport:
    """The repeating period of each communicator's (op, msg_bytes) sequence per process, for the
    run's sources without profiler steps, and the iteration count it implies per process."""
    return _report(run, *_detect(con, run_id_of(con, run)))


def _report(
    run: str, comms: list[_Comm], iterations: dict[ProcKey, int | None], ranks: dict[ProcKey, int | None]
) -> PeriodReport:
    out: list[CommPeriod] = []
    for c in comms:
        iters = iterations.get((c.source_id, c.process))
        if c.period is None:
            out.append(CommPeriod(process=c.process, group_key=c.group_key or c.comm, calls=len(c.items), period=None,
                                  note="no repeating pattern (fewer than 2 repeats or less than half the calls)"))
            continue
        upi = c.period.repeats // iters if iters else None
        out.append(CommPeriod(
            process=c.process, group_key=c.group_key or c.comm, calls=len(c.items), period=c.period.period,
            offset=c.period.offset, repeats=c.period.repeats, units_per_iteration=upi,
            note=None if upi == 1 else f"repeats {upi}x per iteration (a micro-batch-sized unit)" if upi else None,
        ))
    procs = [ProcessIterations(process=p, rank=ranks.get((s, p)), iterations=it)
             for (s, p), it in sorted(iterations.items())]
    found = any(p.iterations for p in procs)
    if not comms:
        message = "every source of the run has profiler steps (or there are no calls): nothing to detect"
    elif found:
        done = sum(1 for p in procs if p.iterations)
        message = f"repeating period found in {done} of {len(procs)} processes"
    else:
        message = "no repeating period found: no communicator repeats its (op, size) sequence at least twice"
    return PeriodReport(run=run, processes=procs, comms=out, found=found, message=message)


@dataclass
class Iterations:
    """Per-event iteration assignment for sources without steps, and iterations per rank key."""

    info: IterationInfo
    detected: pa.Table  # source_id, process, seq, iteration (NULL: outside complete iterations), reason
    report: PeriodReport | None


def rank_key_sql(alias: str = "e") -> str:
    """SQL for the rank identity of an event: its global rank, else its process."""
    return f"coalesce(cast({alias}.rank AS VARCHAR), {alias}.process, '?')"


def assign_iterations(con: duckdb.DuckDBPyConnection, run: str) -> Iterations:
    run_id = run_id_of(con, run)
    # Sources with profiler steps: iterations = distinct steps of the source (steps table, else events).
    step_rows = con.execute(
        f"""
        WITH src AS (
            SELECT DISTINCT source_id FROM comm_events WHERE run_id = ? AND step IS NOT NULL
        ), per_source AS (
            SELECT e.source_id, any_value({rank_key_sql()}) AS rk,
                   greatest(
                     (SELECT count(DISTINCT s.step) FROM steps s WHERE s.run_id = ? AND s.source_id = e.source_id),
                     count(DISTINCT e.step)) AS n
            FROM comm_events e JOIN src USING (source_id)
            WHERE e.run_id = ? GROUP BY e.source_id
        )
        SELECT rk, sum(n)::BIGINT FROM per_source GROUP BY rk
        """,
        [run_id, run_id, run_id],
    ).fetchall()
    iterations: dict[str, int] = {rk: int(n) for rk, n in step_rows if n}

    comms, proc_iters, ranks = _detect(con, run_id)
    cols: dict[str, list] = {"source_id": [], "process": [], "seq": [], "iteration": [], "reason": []}
    for c in comms:
        iters = proc_iters.get((c.source_id, c.process))
        p = c.period
        upi = p.repeats // iters if (p is not None and iters) else 0
        for idx, seq in enumerate(c.seqs):
            cols["source_id"].append(c.source_id)
            cols["process"].append(c.process)
            cols["seq"].append(seq)
            if not iters:
                it, reason = None, "no repeating pattern in its process"
            elif p is None:
                it, reason = None, "communicator without a repeating pattern"
            elif idx < p.offset:
                it, reason = None, "before the repeating pattern (setup)"
            else:
                it = (idx - p.offset) // (p.period * upi)
                reason = None
                if it >= iters:
                    it, reason = None, "after the last complete iteration"
            cols["iteration"].append(it)
            cols["reason"].append(reason)
    for (source_id, process), it in proc_iters.items():
        if it:
            rank = ranks.get((source_id, process))
            rk = str(rank) if rank is not None else process
            iterations[rk] = iterations.get(rk, 0) + it
    detected = pa.table({
        "source_id": pa.array(cols["source_id"], pa.int32()),
        "process": pa.array(cols["process"], pa.string()),
        "seq": pa.array(cols["seq"], pa.int64()),
        "iteration": pa.array(cols["iteration"], pa.int64()),
        "reason": pa.array(cols["reason"], pa.string()),
    })
    has_steps, has_detected = bool(step_rows), any(proc_iters.values())
    if has_steps and has_detected:
        mode, message = "mixed", "profiler steps for traces with steps, detected periods for the other sources"
    elif has_steps:
        mode, message = "steps", "iterations are profiler steps"
    elif has_detected:
        mode, message = "detected", "iterations detected from the repeating (op, size) sequence of each communicator"
    else:
        mode, message = "none", "iterations unknown: no profiler steps and no repeating pattern"
    info = IterationInfo(run=run, mode=mode, iterations=iterations, message=message)  # type: ignore[arg-type]
    report = _report(run, comms, proc_iters, ranks) if comms else None
    return Iterations(info=info, detected=detected, report=report)
