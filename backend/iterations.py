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

Detection runs once per refresh of a run's aggregates (commlens.store.aggregates, which stores the
periods, each process's iterations and each call's iteration); these functions read what it stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import pyarrow as pa

from commlens.contract.analysis import CommPeriod, IterationInfo, PeriodReport, ProcessIterations
from commlens.ingest.periods import MIN_COVERAGE, MIN_REPEATS, Period, find_period, z_function
from commlens.store.aggregates import ensure_fresh, rank_key_sql

__all__ = [
    "MIN_COVERAGE",
    "MIN_REPEATS",
    "Iterations",
    "Period",
    "UnknownRunError",
    "assign_iterations",
    "detect_period",
    "find_period",
    "fresh_run_id",
    "rank_key_sql",
    "run_id_of",
    "z_function",
]


class UnknownRunError(LookupError):
    """The run name is not in the store."""


def run_id_of(con: duckdb.DuckDBPyConnection, run: str) -> int:
    # fetchall, not fetchone: DuckDB refuses register() while a result is only partly fetched.
    rows = con.execute("SELECT run_id FROM runs WHERE name = ?", [run]).fetchall()
    if not rows:
        raise UnknownRunError(f"no run named {run!r} in this store")
    return rows[0][0]


def fresh_run_id(con: duckdb.DuckDBPyConnection, run: str) -> int:
    """The run's id, after bringing its aggregates up to date when they are stale."""
    run_id = run_id_of(con, run)
    ensure_fresh(con, run_id)
    return run_id


def detect_period(con: duckdb.DuckDBPyConnection, run: str) -> PeriodReport:
    """The repeating period of each communicator's (op, msg_bytes) sequence per process, for the
    run's sources without profiler steps, and the iteration count it implies per process."""
    return _report(con, run, fresh_run_id(con, run))


def _report(con: duckdb.DuckDBPyConnection, run: str, run_id: int) -> PeriodReport:
    procs_rows = con.execute(
        "SELECT source_id, process, rank, iterations FROM process_iterations WHERE run_id = ? ORDER BY ord", [run_id]
    ).fetchall()
    iterations = {(s, p): it for s, p, _, it in procs_rows}
    out: list[CommPeriod] = []
    for source_id, process, comm, group_key, calls, period, offset, repeats in con.execute(
        """SELECT source_id, process, comm, group_key, calls, period, offset_calls, repeats
           FROM comm_periods WHERE run_id = ? ORDER BY ord""",
        [run_id],
    ).fetchall():
        iters = iterations.get((source_id, process))
        if period is None:
            out.append(
                CommPeriod(
                    process=process,
                    group_key=group_key or comm,
                    calls=calls,
                    period=None,
                    note="no repeating pattern (fewer than 2 repeats or less than half the calls)",
                )
            )
            continue
        upi = repeats // iters if iters else None
        out.append(
            CommPeriod(
                process=process,
                group_key=group_key or comm,
                calls=calls,
                period=period,
                offset=offset,
                repeats=repeats,
                units_per_iteration=upi,
                note=None if upi == 1 else f"repeats {upi}x per iteration (a micro-batch-sized unit)" if upi else None,
            )
        )
    procs = [ProcessIterations(process=p, rank=rank, iterations=it) for _, p, rank, it in procs_rows]
    found = any(p.iterations for p in procs)
    if not out:
        message = "every source of the run has profiler steps (or there are no calls): nothing to detect"
    elif found:
        done = sum(1 for p in procs if p.iterations)
        message = f"repeating period found in {done} of {len(procs)} processes"
    else:
        message = "no repeating period found: no communicator repeats its (op, size) sequence at least twice"
    return PeriodReport(run=run, processes=procs, comms=out, found=found, message=message)


@dataclass
class Iterations:
    """How a run's calls divide into iterations (from the run's aggregates). `detected` (source_id,
    process, seq, iteration, reason of each call of a source without steps) and `report` (the
    periods) are read from the store when first asked for."""

    info: IterationInfo
    con: duckdb.DuckDBPyConnection = field(repr=False)
    run_id: int = field(repr=False)
    _detected: pa.Table | None = field(default=None, repr=False)

    @property
    def detected(self) -> pa.Table:
        if self._detected is None:
            self._detected = self.con.sql(
                """SELECT source_id, process, seq, cast(iteration AS BIGINT) AS iteration, reason
                   FROM comm_iterations WHERE run_id = ?""",
                params=[self.run_id],
            ).to_arrow_table()
        return self._detected

    @property
    def report(self) -> PeriodReport | None:
        report = _report(self.con, self.info.run, self.run_id)
        return report if report.comms else None


def iteration_info(con: duckdb.DuckDBPyConnection, run: str, run_id: int) -> IterationInfo:
    """Iterations per rank key and the mode, from the run's (fresh) aggregates."""
    state = con.execute("SELECT has_steps, has_detected FROM agg_runs WHERE run_id = ?", [run_id]).fetchall()
    has_steps, has_detected = state[0] if state else (False, False)
    iterations = {
        rk: int(n)
        for rk, n in con.execute(
            "SELECT rank_key, iterations FROM agg_iterations WHERE run_id = ? ORDER BY rank_key", [run_id]
        ).fetchall()
    }
    if has_steps and has_detected:
        mode, message = "mixed", "profiler steps for traces with steps, detected periods for the other sources"
    elif has_steps:
        mode, message = "steps", "iterations are profiler steps"
    elif has_detected:
        mode, message = "detected", "iterations detected from the repeating (op, size) sequence of each communicator"
    else:
        mode, message = "none", "iterations unknown: no profiler steps and no repeating pattern"
    return IterationInfo(run=run, mode=mode, iterations=iterations, message=message)  # type: ignore[arg-type]


def assign_iterations(con: duckdb.DuckDBPyConnection, run: str) -> Iterations:
    run_id = fresh_run_id(con, run)
    return Iterations(info=iteration_info(con, run, run_id), con=con, run_id=run_id)
