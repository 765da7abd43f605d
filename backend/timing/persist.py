"""The time analysis of one stored run, computed at ingest and kept in the time tables (time.sql).

`persist_run` loads the run's counted calls (with their match key and CPU/device spans), its activity
intervals, profiler steps, the groups' schemes and ranks and the hosts NCCL names, runs `analyze`,
and replaces every row of the run in TIME_TABLES in one transaction. NCCL-log calls are keyed by
opCount per communicator (order where NCCL 2.27+ leaves it 0); the logs carry no times, so such runs
get instances and mismatches, and `time_status` says why nothing else. Called by the ingest service's
finalize step after attribution, and again whenever attribution changes a scheme.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from commlens.contract.analysis import UNATTRIBUTED
from commlens.ingest.arrow_views import registered
from commlens.store import transaction
from commlens.store.layout import BREAKDOWN_ORDER, MEMCPY_ORDER
from commlens.store.tables import TIME_TABLES

from . import budget
from .analysis import TimeAnalysis, analyze_columns
from .memcpy_lane import LANE_FIELDS
from .model import F64, KINDS, CallTable, IntervalArrays, Ints, RankArrays, StepArrays
from .segments import sequential_sums
from .store_columns import count_rows, read_columns
from .stragglers import rank_totals
from .untimed import untimed_only

Columns = dict[str, Any]  # column name -> list, numpy array or Arrow array
FETCH_ROWS = 1 << 20
log = logging.getLogger("commlens.backend.timing")


@dataclass
class RunInput:
    ranks: dict[int, RankArrays]
    calls: CallTable  # with source_id
    world_size: int | None
    hosts: dict[int, str] | None
    schemes: dict[str, str]
    timed: bool  # some call has a time (NCCL logs have none)
    source_notes: list[str]
    interval_counts: dict[int, int] = field(default_factory=dict)  # rank -> timeline intervals in the store
    intervals_of: Callable[[int], IntervalArrays] | None = None  # a rank's intervals, read when asked

    def intervals(self, rank: int) -> IntervalArrays:
        """A rank's timeline intervals: read from the store where the load left them there."""
        return self.intervals_of(rank) if self.intervals_of is not None else self.ranks[rank].intervals


def _vocab(con: duckdb.DuckDBPyConnection, column: str, run_id: int) -> list[str]:
    rows = con.execute(
        f"SELECT DISTINCT {column} FROM comm_events WHERE run_id = ? AND counted AND rank IS NOT NULL "
        f"AND {column} IS NOT NULL ORDER BY 1",
        [run_id],
    ).fetchall()
    return [r[0] for r in rows]


def _ints(col: pa.Array | pa.ChunkedArray, null: int = 0) -> Ints:
    return np.asarray(col.fill_null(null).to_numpy(zero_copy_only=False), dtype=np.int64)


def _valid(col: pa.Array | pa.ChunkedArray) -> npt.NDArray[np.bool_]:
    return np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _floats(col: pa.Array | pa.ChunkedArray) -> F64:
    return np.asarray(col.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)


# A run's counted calls of known rank, strings as codes into the vocabularies passed in ($ops, $dtypes,
# $groups); {times}: the time columns, or nothing where the run has none.
_CALLS = """
    SELECT e.rank, e.source_id, e.seq, list_position($ops, e.op) - 1 AS op,
           coalesce(list_position($dtypes, e.dtype) - 1, -1) AS dtype, e.msg_bytes,
           coalesce(list_position($groups, e.group_key) - 1, -1) AS grp, e.group_size,
           CASE WHEN s.kind = 'nccl_log' THEN e.op_count ELSE e.match_key END AS key, e.step{times}
    FROM comm_events e JOIN sources s USING (source_id)
    WHERE e.run_id = $run AND e.counted AND e.rank IS NOT NULL
"""
_CALL_INTS = {"rank": 0, "source_id": 0, "seq": 0, "op": 0, "dtype": -1, "grp": -1, "group_size": -1}
_CALL_FLAGGED = ("msg_bytes", "key", "step")


def _in_call_order(c: dict[str, npt.NDArray[Any]]) -> None:
    """Put the columns read by _CALLS in (rank, source, seq) order: each rank's calls as issued."""
    # Sorted here, not by DuckDB: its sort of a 10M-row result kept about 2 GB after it was done. Rows
    # read in that order already (one file per rank, as stored) are left as they are.
    if not _ascending(c["rank"], c["source_id"], c["seq"]):
        _permute(c, np.lexsort((c["seq"], c["source_id"], c["rank"])))


def _call_table(
    c: Mapping[str, npt.NDArray[Any]],
    ops: list[str],
    dtypes: list[str],
    groups: list[str],
    group_ranks: Mapping[str, tuple[int, ...] | None],
) -> CallTable:
    """The CallTable of the columns read by _CALLS (with arrival and end_us), in call order."""
    return CallTable(
        rank=c["rank"],
        seq=c["seq"],
        op=c["op"],
        ops=ops,
        dtype=c["dtype"],
        dtypes=dtypes,
        msg_bytes=c["msg_bytes"],
        has_bytes=c["has_msg_bytes"],
        group=c["grp"],
        groups=groups,
        group_size=c["group_size"],
        match_key=c["key"],
        has_key=c["has_key"],
        step=c["step"],
        has_step=c["has_step"],
        arrival=c["arrival"],
        end=c["end_us"],
        group_ranks=[group_ranks.get(g) if g else None for g in groups],
        world_ranks=None,
        source_id=c["source_id"],
    )


def _group_ranks(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, tuple[int, ...] | None]:
    return {
        k: tuple(v) if v else None
        for k, v in con.execute("SELECT group_key, ranks FROM process_groups WHERE run_id = ?", [run_id]).fetchall()
    }


def _run_facts(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[int | None, dict[int, str] | None, dict[str, str]]:
    """The run's world size, the hosts NCCL names per rank (None: none known) and the groups' schemes."""
    hosts = dict(
        con.execute(
            "SELECT global_rank, min(host) FROM nccl_comms WHERE run_id = ? AND global_rank IS NOT NULL "
            "AND host IS NOT NULL GROUP BY global_rank",
            [run_id],
        ).fetchall()
    )
    schemes = dict(
        con.execute(
            "SELECT group_key, scheme FROM process_groups WHERE run_id = ? AND scheme IS NOT NULL", [run_id]
        ).fetchall()
    )
    world = con.execute("SELECT world_size FROM runs WHERE run_id = ?", [run_id]).fetchall()
    return world[0][0] if world else None, hosts or None, schemes


def load_untimed(con: duckdb.DuckDBPyConnection, run_id: int) -> RunInput | None:
    """load_run's RunInput for a run whose calls carry no time and that has nothing else timed (untimed.py:
    an NCCL-log run), read with less work; None for any other run."""
    if not untimed_only(con, run_id):
        return None
    group_ranks = _group_ranks(con, run_id)
    ops, dtypes, groups = (_vocab(con, c, run_id) for c in ("op", "dtype", "group_key"))
    params = {"ops": ops or [""], "dtypes": dtypes or [""], "groups": groups or [""], "run": run_id}
    sql = _CALLS.format(times="")
    n = count_rows(con, sql, params)
    c = read_columns(con, sql, params, n, FETCH_ROWS, _CALL_INTS, _CALL_FLAGGED)
    _in_call_order(c)
    # no time anywhere: one read-only NaN seen n times instead of two columns to allocate and reorder
    c["arrival"] = c["end_us"] = np.broadcast_to(np.float64(np.nan), (n,))
    calls = _call_table(c, ops, dtypes, groups, group_ranks)
    del c
    ranks = {
        r: RankArrays(r, False, _no_intervals(), StepArrays(*_empty(np.int64, np.float64, np.float64)))
        for r in np.unique(calls.rank).tolist()
    }
    world, hosts, schemes = _run_facts(con, run_id)
    pa.default_memory_pool().release_unused()
    return RunInput(ranks, calls, world, hosts, schemes, False, [])


def load_run(con: duckdb.DuckDBPyConnection, run_id: int) -> RunInput:
    """One run's analysis input from the store as columns (calls of unknown rank are left out: they
    match nothing). Strings come as codes computed in DuckDB, so no Python object is made per row."""
    group_ranks = _group_ranks(con, run_id)
    ops, dtypes, groups = (_vocab(con, c, run_id) for c in ("op", "dtype", "group_key"))
    c = _fetch(
        con,
        _CALLS.format(times=", e.ts_us AS arrival, e.ts_us + e.dur_us AS end_us"),
        {"ops": ops or [""], "dtypes": dtypes or [""], "groups": groups or [""], "run": run_id},
        ints=_CALL_INTS,
        flagged=_CALL_FLAGGED,
        floats=("arrival", "end_us"),
    )
    _in_call_order(c)
    calls = _call_table(c, ops, dtypes, groups, group_ranks)
    del c
    ranks: dict[int, RankArrays] = {}

    def rank_of(r: int) -> RankArrays:
        if r not in ranks:
            ranks[r] = RankArrays(r, False, _no_intervals(), StepArrays(*_empty(np.int64, np.float64, np.float64)))
        return ranks[r]

    for r in np.unique(calls.rank).tolist():
        rank_of(r)
    steps = con.sql(
        "SELECT rank, step, ts_us, ts_us + dur_us AS end_us FROM steps WHERE run_id = ? AND rank IS NOT NULL "
        "AND ts_us IS NOT NULL AND dur_us IS NOT NULL ORDER BY rank, ts_us",
        params=[run_id],
    ).to_arrow_table()
    for r, (a, b) in _by_rank(_ints(steps["rank"])):
        rank_of(r).steps = StepArrays(
            _ints(steps["step"])[a:b], _floats(steps["ts_us"])[a:b], _floats(steps["end_us"])[a:b]
        )
    counts = dict(
        con.execute(
            "SELECT rank, count(*) FROM timeline_intervals WHERE run_id = ? AND rank IS NOT NULL GROUP BY rank",
            [run_id],
        ).fetchall()
    )
    for r in counts:
        rank_of(r)
    notes: list[str] = []
    for r, has_device, tl_notes in con.execute(
        """
        SELECT rank, CAST(meta->'$.timeline.has_device' AS BOOLEAN), CAST(meta->'$.timeline.notes' AS VARCHAR[])
        FROM sources WHERE run_id = ? AND status = 'ok' AND kind = 'kineto' ORDER BY rank, source_id
        """,
        [run_id],
    ).fetchall():
        if r is not None:
            rank_of(r).has_device = rank_of(r).has_device or bool(has_device)
        notes.extend(f"rank {'?' if r is None else r}: {n}" for n in tl_notes or [])
    world, hosts, schemes = _run_facts(con, run_id)
    timed = bool((~np.isnan(calls.arrival)).any())
    ordered = dict(sorted(ranks.items()))
    pa.default_memory_pool().release_unused()  # the read's Arrow memory: the pool keeps what is freed otherwise
    return RunInput(ordered, calls, world, hosts, schemes, timed, notes, counts, _IntervalReader(con, run_id, counts))


class _IntervalReader:
    """One rank's timeline intervals from the store, read when the analysis reaches that rank (the rows of a
    rank are contiguous in the table, as each file's are written together, so DuckDB reads only its row
    groups), by kind (by name), stream and start, as the analysis expects them."""

    _SQL = (
        "SELECT coalesce(list_position($kinds, kind) - 1, -1) AS kind, stream, start_us, end_us, nbytes "
        "FROM timeline_intervals WHERE run_id = $run AND rank = $rank"
    )

    def __init__(self, con: duckdb.DuckDBPyConnection, run_id: int, counts: Mapping[int, int]) -> None:
        self._con, self._run, self._counts = con, run_id, counts

    def __call__(self, rank: int) -> IntervalArrays:
        n = self._counts.get(rank, 0)
        if not n:
            return _no_intervals()
        params = {"kinds": list(KINDS), "run": self._run, "rank": rank}
        ints = {"kind": -1, "stream": np.iinfo(np.int64).max, "nbytes": 0}
        iv = read_columns(self._con, self._SQL, params, n, FETCH_ROWS, ints, floats=("start_us", "end_us"))
        by_name = np.append(np.argsort(np.argsort(KINDS)), len(KINDS))  # code -1: the last entry
        _permute(iv, np.lexsort((iv["start_us"], iv["stream"], by_name[iv["kind"]])))
        stream = np.where(iv["stream"] == np.iinfo(np.int64).max, -1, iv["stream"])
        return IntervalArrays(iv["kind"], stream, iv["start_us"], iv["end_us"], iv["nbytes"])


def _fetch(
    con: duckdb.DuckDBPyConnection,
    sql: str,
    params: dict[str, Any],
    ints: Mapping[str, int],
    floats: Sequence[str] = (),
    flagged: Sequence[str] = (),
) -> dict[str, npt.NDArray[Any]]:
    """A query's columns as numpy arrays filled in place (store_columns): `ints` with the value given for
    null, `floats` with NaN, `flagged` as ints (null: 0) and `has_<name>` flags."""
    return read_columns(con, sql, params, count_rows(con, sql, params), FETCH_ROWS, ints, flagged, floats)


def _ascending(*keys: Ints) -> bool:
    """Whether the rows are in (keys[0], keys[1], ...) order, ties kept: what a stable lexsort leaves alone."""
    if len(keys[0]) < 2:
        return True
    tied = np.ones(len(keys[0]) - 1, dtype=bool)  # rows i, i + 1 equal on the keys so far
    for k in keys:
        step = k[1:] - k[:-1]
        if (tied & (step < 0)).any():
            return False
        tied &= step == 0
    return True


def _permute(columns: dict[str, npt.NDArray[Any]], order: Ints) -> None:
    """Reorder every column, one at a time (one extra column in memory, not all)."""
    for name in list(columns):
        columns[name] = columns[name][order]


def _empty(*dtypes: type) -> list[npt.NDArray[Any]]:
    return [np.zeros(0, dtype=d) for d in dtypes]


def _no_intervals() -> IntervalArrays:
    return IntervalArrays(*_empty(np.int64, np.int64, np.float64, np.float64, np.int64))


def _by_rank(rank: Ints) -> Iterator[tuple[int, tuple[int, int]]]:
    """The row ranges of each rank in rows sorted by rank."""
    if not len(rank):
        return
    cut = np.flatnonzero(rank[1:] != rank[:-1]) + 1
    starts, ends = [0, *cut.tolist()], [*cut.tolist(), len(rank)]
    for a, b in zip(starts, ends, strict=True):
        yield int(rank[a]), (a, b)


def persist_run(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Compute the run's time analysis and replace its rows in the time tables, in one transaction. An
    analysis that fails, or that would need more memory than it may hold (budget.py), leaves the run's files
    and other analyses alone: its time_status says why."""
    try:
        calls, intervals, need = budget.estimate(con, run_id)
        total, source = budget.budget()
        if need > total:
            tables = _not_computed(budget.refusal(calls, intervals, need, total, source))
        else:
            with budget.BUDGET.reserve(need, total):
                tables = analysed_tables(con, run_id)
    except Exception as exc:  # a bug or an input the analysis cannot take must not fail the ingest
        log.exception("time analysis of run %s", run_id)
        tables = _not_computed(f"the time analysis failed: {type(exc).__name__}: {exc}")
    write_tables(con, run_id, tables)


def _not_computed(reason: str) -> dict[str, Columns]:
    return {"time_status": {"part": ["matching"], "ok": [False], "reason": [reason]}}


def write_tables(con: duckdb.DuckDBPyConnection, run_id: int, tables: Mapping[str, Columns]) -> None:
    """Replace the run's rows in every time table with `tables`' (table -> columns), in one transaction."""

    def write(c: duckdb.DuckDBPyConnection) -> None:
        for table in TIME_TABLES:  # fixed names
            c.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        for table, columns in tables.items():
            _insert(c, table, run_id, columns)

    transaction(con, write)


def analysed_tables(con: duckdb.DuckDBPyConnection, run_id: int, general: bool = False) -> dict[str, Columns]:
    """The run's time tables; the input and the analysis are dropped on return, before the write. A run
    without times is read by load_untimed (the same input, less work) unless `general` asks for load_run,
    the read of every run (tests compare the two)."""
    data = None if general else load_untimed(con, run_id)
    if data is None:
        data = load_run(con, run_id)
    job = (
        analyze_columns(
            data.ranks, data.calls, data.world_size, data.hosts, data.schemes, intervals_of=data.intervals_of
        )
        if data.ranks
        else None
    )
    return result_tables(data, job)


_ORDER = {"time_breakdown": BREAKDOWN_ORDER, "time_memcpy": MEMCPY_ORDER}


def _insert(con: duckdb.DuckDBPyConnection, table: str, run_id: int, columns: Columns) -> None:
    n = len(next(iter(columns.values())))
    if not n:
        return
    with registered(con, pa.table(columns), "_commlens_time"):
        listed = ", ".join(columns)
        # the step-block layout (commlens/store/layout.py) lets reads of one step and of one rank prune
        order = f" ORDER BY {_ORDER[table].removeprefix('run_id, ')}" if table in _ORDER else ""
        con.execute(f"INSERT INTO {table} (run_id, {listed}) SELECT ?, {listed} FROM _commlens_time{order}", [run_id])


def result_tables(data: RunInput, job: TimeAnalysis | None) -> dict[str, Columns]:
    """The time tables' rows of one analysed run (columns without run_id)."""
    status: dict[tuple[str, str], bool] = {}
    if job is None:
        status[("matching", "no call of a known rank: nothing to match")] = False
        return {"time_status": _status_columns(status)}
    out: dict[str, Columns] = {
        "time_instances": _instances(job, data.schemes),
        "time_instance_members": _members(job, data),
        "time_mismatches": _mismatches(job),
        "time_unmatched": {
            "reason": list(job.match.not_matched),
            "calls": list(job.match.not_matched.values()),
        },
        "time_clock_offsets": _clocks(job, data),
        "time_breakdown": _breakdown(job),
        "time_memcpy": _ensure(job.breakdown.memcpy, LANE_FIELDS),
        "time_rank_totals": _rank_totals(job, data),
        "time_arrivals": _arrivals(job),
        "time_stragglers": _stragglers(job),
        **_critical(job),
    }
    _statuses(job, data, status)
    out["time_status"] = _status_columns(status)
    return out


def _status_columns(status: Mapping[tuple[str, str], bool]) -> Columns:
    return {
        "part": [p for p, _ in status],
        "ok": list(status.values()),
        "reason": [r for _, r in status],
    }


def _statuses(job: TimeAnalysis, data: RunInput, status: dict[tuple[str, str], bool]) -> None:
    inst, match = job.match.instances, job.match
    keyed = int(inst.by_key.sum())
    status[("matching", f"{len(inst)} instances matched ({keyed} by key, {len(inst) - keyed} by call order)")] = True
    missing = sum(m.reason == "missing on a member" for m in match.mismatches)
    if missing:
        status[("matching", f"{missing} calls missing on some members: instances missing on some ranks")] = False
    other = len(match.mismatches) - missing
    if other:
        status[("matching", f"{other} calls whose members disagree (op, dtype or size): not paired")] = False
    for reason, n in match.not_matched.items():
        status[("matching", f"{n} calls not matched: {reason}")] = reason.startswith("send/recv")
    status[("clocks", job.clocks.reason)] = job.clocks.trusted
    if not data.timed:
        status[("waits", "the calls carry no times (NCCL logs): no arrivals, skew or waits")] = False
        status[("breakdown", "the calls carry no times (NCCL logs): no per-step breakdown")] = False
        status[("critical_path", "the calls carry no times (NCCL logs): no critical path")] = False
    for note in job.stats.notes:
        status[("waits", note)] = False
    if data.timed and not job.stats.notes:
        status[("waits", f"waits of {int((~np.isnan(job.stats.skew)).sum())} instances")] = True
    for note, rests_on in _per_rank_notes([*job.breakdown.notes, *data.source_notes]):
        status[("breakdown", note)] = rests_on
    if len(job.breakdown.rank):
        status[("breakdown", f"{len(job.breakdown.rank)} rank-steps")] = True
    _memcpy_status(data, status)
    for g, verdict in sorted(job.stragglers.verdicts.items()):
        status[("stragglers", f"{g}: {verdict}")] = True
    for p in job.paths:
        if p.note:
            status[("critical_path", f"step {p.step}: {p.note}")] = False
    if job.paths and not any(p.note for p in job.paths):
        status[("critical_path", f"{len(job.paths)} steps")] = True


# A rank without device activity whose trace lists no devices (gloo on CPU): its breakdown is of CPU times
_CPU_ONLY = (
    "no device activity: compute is CPU ops, communication the calls' CPU time",
    "no device activity: communication is the collectives' CPU time (gloo), compute the other CPU ops",
)
_RANK_NOTE = re.compile(r"rank (\d+|\?): (.*)", re.S)


def _per_rank_notes(notes: Sequence[str]) -> list[tuple[str, bool]]:
    """Notes of the form 'rank N: text' once per text, naming its ranks ('ranks 0-3: ...'; it was one row per
    rank and per source, twice for a gloo run's every rank), each with whether the breakdown was computed on
    what it says: a gloo rank's breakdown of CPU times is no failure."""
    ranks: dict[str, list[str]] = {}
    for note in notes:
        m = _RANK_NOTE.fullmatch(note)
        text, rank = (m.group(2), m.group(1)) if m else (note, None)
        if text in _CPU_ONLY:  # the timeline's note and the breakdown's say one thing
            text = _CPU_ONLY[0]
        listed = ranks.setdefault(text, [])
        if rank is not None and rank not in listed:
            listed.append(rank)
    out = []
    for text, rs in ranks.items():
        known = sorted(int(r) for r in rs if r != "?")
        who = ", ".join([*_spans(known), *(["?"] if "?" in rs else [])])
        label = f"rank{'s' if len(rs) > 1 else ''} {who}: {text}" if rs else text
        out.append((label, text == _CPU_ONLY[0]))
    return out


def _spans(ranks: list[int]) -> list[str]:
    """[0, 1, 2, 5] as ['0-2', '5']."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return [str(a) if a == b else f"{a}-{b}" for a, b in runs]


def _memcpy_status(data: RunInput, status: dict[tuple[str, str], bool]) -> None:
    no_device = sorted(r for r, d in data.ranks.items() if not d.has_device and data.interval_counts.get(r))
    if no_device:
        status[("memcpy", f"no device activity on ranks {no_device}: no memcpy lane there")] = False
    if any(d.has_device for d in data.ranks.values()):
        status[("memcpy", "memcpy lane from the device copies and memsets")] = True
    else:
        status[("memcpy", "no device activity recorded (no profiler trace with CUDA activity): no memcpy lane")] = False


def _strings(vocab: Sequence[str | None], codes: Ints) -> pa.Array:
    """Codes into `vocab` as an Arrow string column (-1: null), without a Python object per row: dictionary
    encoded (DuckDB stores the strings; a `take` into plain strings cost 0.16 CPU s per 786k instances)."""
    return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), pa.array(vocab, type=pa.string()))


def _nullable(values: npt.NDArray[Any], valid: npt.NDArray[np.bool_]) -> pa.Array:
    return pa.array(values, mask=~valid)


def _f(values: F64) -> pa.Array:
    """A float column, NaN as null."""
    return pa.array(values, from_pandas=True)


def _instances(job: TimeAnalysis, schemes: Mapping[str, str]) -> Columns:
    inst, st = job.match.instances, job.stats
    return {
        "instance_id": np.arange(len(inst), dtype=np.int64),
        "group_key": _strings(inst.groups, inst.group_code),
        "scheme": _strings([schemes.get(g) for g in inst.groups], inst.group_code),
        "op": _strings(inst.ops, inst.op_code),
        "dtype": _strings(inst.dtypes, inst.dtype_code),
        "msg_bytes": _nullable(inst.size, inst.has_size),
        "step": _nullable(inst.steps, inst.has_step),
        "match_key": inst.keys,
        "keyed_by": _strings(["order", "key"], inst.by_key.astype(np.int64)),
        "members": inst.members,
        "first_arrival_ref_us": _f(st.last - st.skew),
        "last_arrival_ref_us": _f(st.last),
        "last_rank": _nullable(st.last_rank_code, st.last_rank_code >= 0),
        "skew_us": _f(st.skew),
        "real_us": _f(st.real),
        "algbw_gbps": _f(st.algbw),
        "busbw_gbps": _f(st.busbw),
        "last_own_us": _f(job.stragglers.last_own_us),
    }


def _members(job: TimeAnalysis, data: RunInput) -> Columns:
    inst, st, clocks = job.match.instances, job.stats, job.clocks
    t = data.calls
    assert t.source_id is not None
    return {
        "instance_id": inst.m_inst,
        "rank": inst.m_rank,
        "source_id": _member_sources(t, t.source_id, inst.m_row),
        "seq": inst.m_seq,
        "arrival_ref_us": _f(st.m_arrival_ref),
        "end_ref_us": _f(inst.m_end + clocks.offset_of(inst.m_rank)),
        "wait_us": _f(st.m_wait),
    }


def _member_sources(t: CallTable, source_id: Ints, rows: Ints) -> Ints:
    """Each member's source: the last call (store order) of its rank with its seq. With one source per
    rank that is the member's own call; else a (rank, seq) seen in two sources takes the later one."""
    if not len(t):
        return source_id[rows]
    new_rank = np.r_[True, t.rank[1:] != t.rank[:-1]]
    new_source = new_rank | np.r_[True, source_id[1:] != source_id[:-1]]
    if int(new_rank.sum()) == int(new_source.sum()):  # rows are by rank, source: one source per rank
        return source_id[rows]
    o = np.lexsort((np.arange(len(t)), t.seq, t.rank))
    r_s, q_s = t.rank[o], t.seq[o]
    last = np.r_[(r_s[1:] != r_s[:-1]) | (q_s[1:] != q_s[:-1]), True]
    group = np.empty(len(t), dtype=np.int64)
    group[o] = np.cumsum(np.r_[True, last[:-1]]) - 1
    return source_id[o][last][group[rows]]


def _ensure(out: Columns, names: Sequence[str]) -> Columns:
    """Every named column, empty ones included, in order (an empty result still has its columns)."""
    return {n: out.get(n, []) for n in names}


def _mismatches(job: TimeAnalysis) -> Columns:
    ms = job.match.mismatches
    return {
        "group_key": [m.group for m in ms],
        "position": [m.position for m in ms],
        "reason": [m.reason for m in ms],
        "rank_a": [m.rank_a for m in ms],
        "side_a": [m.side_a for m in ms],
        "rank_b": [m.rank_b for m in ms],
        "side_b": [m.side_b for m in ms],
    }


def _clocks(job: TimeAnalysis, data: RunInput) -> Columns:
    c = job.clocks
    est = {r: d for d in c.domains for r in d.ranks}
    ranks = sorted(data.ranks)
    return {
        "rank": ranks,
        "domain": [est[r].domain if r in est else None for r in ranks],
        "offset_us": [c.offsets.get(r, 0.0) for r in ranks],
        "estimate_us": [est[r].offset_us if r in est else None for r in ranks],
        "spread_us": [est[r].spread_us if r in est else None for r in ranks],
        "instances": [est[r].instances if r in est else None for r in ranks],
        "applied": [c.applied] * len(ranks),
        "trusted": [c.trusted] * len(ranks),
        "reason": [c.reason] * len(ranks),
    }


def _breakdown(job: TimeAnalysis) -> Columns:
    b = job.breakdown
    n, m = len(b.rank), len(b.scheme_rank)
    none = np.full(m, np.nan)
    return {
        "rank": np.concatenate([b.rank, b.scheme_rank]),
        "step": np.concatenate([b.step, b.scheme_step]),
        "scheme": pa.concat_arrays([pa.nulls(n, pa.string()), pa.array(b.scheme, type=pa.string())]),
        "step_us": _f(np.concatenate([b.step_us, none])),
        "compute_us": _f(np.concatenate([b.compute_us, none])),
        "overlapped_us": np.concatenate([b.overlapped_us, b.scheme_overlapped]),
        "wait_us": np.concatenate([b.wait_us, b.scheme_wait]),
        "exposed_us": np.concatenate([b.exposed_us, b.scheme_exposed]),
        "memcpy_us": _f(np.concatenate([b.memcpy_us, none])),
        "idle_us": _f(np.concatenate([b.idle_us, none])),
    }


def _rank_totals(job: TimeAnalysis, data: RunInput) -> Columns:
    t = rank_totals(job.match.instances, job.stats)
    imposed: dict[int, float] = defaultdict(float)
    for r, x in zip(job.stragglers.ranks.rank, job.stragglers.ranks.imposed_us, strict=True):
        imposed[r] += x
    b = job.breakdown
    ranks_b, counts = np.unique(b.rank, return_counts=True)  # rows are by rank, in rank order
    sums = sequential_sums(np.stack([b.step_us, b.wait_us + b.exposed_us, b.overlapped_us], axis=1), counts)
    per = {int(r): row for r, row in zip(ranks_b.tolist(), sums.tolist(), strict=True)}
    known = dict(zip(t.rank, zip(t.instances, t.arrived_last, t.wait_us, strict=True), strict=True))
    ranks = sorted(data.ranks)
    return {
        "rank": ranks,
        "steps": [len(data.ranks[r].steps) for r in ranks],
        "instances": [known.get(r, (0, 0, 0.0))[0] for r in ranks],
        "arrived_last": [known.get(r, (0, 0, 0.0))[1] for r in ranks],
        "wait_us": [known.get(r, (0, 0, 0.0))[2] for r in ranks],
        "imposed_us": [imposed.get(r, 0.0) for r in ranks],
        "step_us": [per[r][0] if r in per else None for r in ranks],
        "exposed_us": [per[r][1] if r in per else None for r in ranks],
        "overlapped_us": [per[r][2] if r in per else None for r in ranks],
    }


def _arrivals(job: TimeAnalysis) -> Columns:
    a = job.stragglers.ranks
    return {
        "group_key": a.group,
        "scheme": [None if s == UNATTRIBUTED else s for s in a.scheme],
        "rank": a.rank,
        "instances": a.instances,
        "arrived_last": a.arrived_last,
        "imposed_us": a.imposed_us,
        "wait_us": a.wait_us,
        "steps": a.steps,
        "steps_mostly_last": a.steps_mostly_last,
    }


def _stragglers(job: TimeAnalysis) -> Columns:
    rep = job.stragglers
    named = {s.group: s for s in rep.stragglers}
    a = rep.ranks
    scheme_of = dict(zip(a.group, a.scheme, strict=True))
    cand: dict[str, tuple[tuple[int, float], int]] = {}
    for g, r, mostly, imposed in zip(a.group, a.rank, a.steps_mostly_last, a.imposed_us, strict=True):
        if g not in cand or (mostly, imposed) > cand[g][0]:
            cand[g] = ((mostly, imposed), r)
    groups = sorted(rep.verdicts)
    out: Columns = defaultdict(list)
    for g in groups:
        s = named.get(g)
        sc = scheme_of.get(g)
        out["group_key"].append(g)
        out["scheme"].append(None if sc in (None, UNATTRIBUTED) else sc)
        out["straggler"].append(s is not None)
        out["rank"].append(s.rank if s else None)
        out["candidate_rank"].append(s.rank if s else (cand[g][1] if g in cand else None))
        out["arrived_last_share"].append(s.arrived_last_share if s else None)
        out["steps_mostly_last"].append(s.steps_mostly_last if s else None)
        out["steps"].append(s.steps if s else None)
        out["imposed_us_per_step"].append(s.imposed_us_per_step if s else None)
        out["instances"].append(s.instances if s else None)
        out["reason"].append(rep.verdicts[g])
    return _ensure(
        out,
        (
            "group_key",
            "scheme",
            "straggler",
            "rank",
            "candidate_rank",
            "arrived_last_share",
            "steps_mostly_last",
            "steps",
            "imposed_us_per_step",
            "instances",
            "reason",
        ),
    )


_PATH_COLUMNS = ("compute", "overlapped", "wait", "exposed", "memcpy", "idle")


def _critical(job: TimeAnalysis) -> dict[str, Columns]:
    path: Columns = defaultdict(list)
    segs: Columns = defaultdict(list)
    shares: Columns = defaultdict(list)
    for p in job.paths:
        if p.note is not None and p.note.endswith("is on no rank"):
            continue
        path["step"].append(p.step)
        path["start_ref_us"].append(p.start)
        path["end_ref_us"].append(p.end)
        for c in _PATH_COLUMNS:
            path[f"{c}_us"].append(p.categories.get(c))
        path["note"].append(p.note)
        for i, seg in enumerate(p.segments):
            segs["step"].append(p.step)
            segs["seg"].append(i)
            segs["rank"].append(seg.rank)
            segs["start_ref_us"].append(seg.start)
            segs["end_ref_us"].append(seg.end)
            segs["kind"].append(seg.kind)
            segs["instance_id"].append(seg.instance)
        for sc, share in p.exposed_share_by_scheme.items():
            shares["step"].append(p.step)
            shares["scheme"].append(sc)
            shares["exposed_share"].append(share)
    return {
        "time_critical_path": _ensure(
            path, ("step", "start_ref_us", "end_ref_us", *(f"{c}_us" for c in _PATH_COLUMNS), "note")
        ),
        "time_critical_segments": _ensure(
            segs, ("step", "seg", "rank", "start_ref_us", "end_ref_us", "kind", "instance_id")
        ),
        "time_critical_schemes": _ensure(shares, ("step", "scheme", "exposed_share")),
    }
