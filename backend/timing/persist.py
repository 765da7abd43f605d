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
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from commlens.store import transaction
from commlens.store.tables import TIME_TABLES

from .analysis import TimeAnalysis, analyze
from .breakdown import UNATTRIBUTED
from .model import MEMORY_KINDS
from .segments import sparse_sum
from .stragglers import rank_totals

Columns = dict[str, list[Any]]
log = logging.getLogger("commlens.backend.timing")


@dataclass
class StoredIntervals:
    kind: list[str] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)


@dataclass
class StoredSteps:
    step: list[int] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)


@dataclass
class StoredCalls:
    """A rank's calls in issue order, as the analysis reads them (model.Calls); `source_id` maps each
    back to its comm_events row with `seq`."""

    source_id: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    op: list[str] = field(default_factory=list)
    dtype: list[str | None] = field(default_factory=list)
    msg_bytes: list[int | None] = field(default_factory=list)
    group_key: list[str | None] = field(default_factory=list)
    group_ranks: list[tuple[int, ...] | None] = field(default_factory=list)
    group_size: list[int | None] = field(default_factory=list)
    match_key: list[int | None] = field(default_factory=list)
    step: list[int | None] = field(default_factory=list)
    arrival: list[float | None] = field(default_factory=list)
    end: list[float | None] = field(default_factory=list)


@dataclass
class StoredRank:
    rank: int
    has_device: bool
    intervals: StoredIntervals
    steps: StoredSteps
    calls: StoredCalls


@dataclass
class RunInput:
    ranks: dict[int, StoredRank]
    world_size: int | None
    hosts: dict[int, str] | None
    schemes: dict[str, str]
    timed: bool  # some call has a time (NCCL logs have none)
    source_notes: list[str]


def load_run(con: duckdb.DuckDBPyConnection, run_id: int) -> RunInput:
    """One run's analysis input from the store (calls of unknown rank are left out: they match nothing)."""
    ranks: dict[int, StoredRank] = {}

    def rank_of(r: int) -> StoredRank:
        if r not in ranks:
            ranks[r] = StoredRank(r, False, StoredIntervals(), StoredSteps(), StoredCalls())
        return ranks[r]

    group_ranks = {
        k: tuple(v) if v else None
        for k, v in con.execute("SELECT group_key, ranks FROM process_groups WHERE run_id = ?", [run_id]).fetchall()
    }
    calls = con.sql(
        """
        SELECT e.rank, e.source_id, e.seq, e.op, e.dtype, e.msg_bytes, e.group_key, e.group_size,
               CASE WHEN s.kind = 'nccl_log' THEN e.op_count ELSE e.match_key END, e.step, e.ts_us,
               e.ts_us + e.dur_us
        FROM comm_events e JOIN sources s USING (source_id)
        WHERE e.run_id = ? AND e.counted AND e.rank IS NOT NULL
        ORDER BY e.rank, e.source_id, e.seq
        """,
        params=[run_id],
    ).to_arrow_table()
    timed = False
    for r, rows in _by_rank(calls):
        src, seq, op, dtype, size, gk, gsize, key, step, arr, end = rows
        ranks[r] = StoredRank(
            r,
            False,
            StoredIntervals(),
            StoredSteps(),
            StoredCalls(
                src,
                seq,
                op,
                dtype,
                size,
                gk,
                [group_ranks.get(g) if g else None for g in gk],
                gsize,
                key,
                step,
                arr,
                end,
            ),
        )
        timed = timed or any(a is not None for a in arr)
    steps = con.sql(
        "SELECT rank, step, ts_us, ts_us + dur_us FROM steps WHERE run_id = ? AND rank IS NOT NULL "
        "AND ts_us IS NOT NULL AND dur_us IS NOT NULL ORDER BY rank, ts_us",
        params=[run_id],
    ).to_arrow_table()
    for r, (step, ts, end) in _by_rank(steps):
        rank_of(r).steps = StoredSteps(step, ts, end)
    iv = con.sql(
        "SELECT rank, kind, stream, start_us, end_us, nbytes FROM timeline_intervals "
        "WHERE run_id = ? AND rank IS NOT NULL ORDER BY rank, kind, stream, start_us",
        params=[run_id],
    ).to_arrow_table()
    for r, (kind, stream, s, e, b) in _by_rank(iv):
        rank_of(r).intervals = StoredIntervals(kind, stream, s, e, b)
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
    world = con.execute("SELECT world_size FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return RunInput(ranks, world[0] if world else None, hosts or None, schemes, timed, notes)


def _by_rank(table: pa.Table) -> Iterator[tuple[int, list[list[Any]]]]:
    """The rows of a table sorted by its first column (rank), as that rank's columns (Python lists):
    one conversion per column, not one per row."""
    if not table.num_rows:
        return
    rank = table.column(0).to_numpy()
    cut = np.flatnonzero(rank[1:] != rank[:-1]) + 1
    starts, ends = [0, *cut.tolist()], [*cut.tolist(), table.num_rows]
    cols = [c.to_pylist() for c in table.columns[1:]]
    for a, b in zip(starts, ends, strict=True):
        yield int(rank[a]), [c[a:b] for c in cols]


def persist_run(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Compute the run's time analysis and replace its rows in the time tables, in one transaction. An
    analysis that fails leaves the run's files and other analyses alone: its time_status says why."""
    try:
        data = load_run(con, run_id)
        job = analyze(data.ranks, data.world_size, data.hosts, data.schemes) if data.ranks else None
        tables = result_tables(data, job)
    except Exception as exc:  # a bug or an input the analysis cannot take must not fail the ingest
        log.exception("time analysis of run %s", run_id)
        reason = f"the time analysis failed: {type(exc).__name__}: {exc}"
        tables = {"time_status": {"part": ["matching"], "ok": [False], "reason": [reason]}}

    def write(c: duckdb.DuckDBPyConnection) -> None:
        for table in TIME_TABLES:  # fixed names
            c.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        for table, columns in tables.items():
            _insert(c, table, run_id, columns)

    transaction(con, write)


def _insert(con: duckdb.DuckDBPyConnection, table: str, run_id: int, columns: Columns) -> None:
    n = len(next(iter(columns.values())))
    if not n:
        return
    con.register("_commlens_time", pa.table(columns))
    try:
        listed = ", ".join(columns)
        con.execute(f"INSERT INTO {table} (run_id, {listed}) SELECT ?, {listed} FROM _commlens_time", [run_id])
    finally:
        con.unregister("_commlens_time")


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
        "time_memcpy": _memcpy(data),
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
    keyed = sum(k == "key" for k in inst.keyed_by)
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
        status[("waits", f"waits of {sum(s is not None for s in job.stats.skew_us)} instances")] = True
    for note in job.breakdown.notes:
        status[("breakdown", note)] = False
    for note in data.source_notes:
        status[("breakdown", note)] = False
    if job.breakdown.rank:
        status[("breakdown", f"{len(job.breakdown.rank)} rank-steps")] = True
    no_device = sorted(r for r, d in data.ranks.items() if not d.has_device and d.intervals.kind)
    if no_device:
        status[("memcpy", f"no device activity on ranks {no_device}: no memcpy lane there")] = False
    status[("memcpy", "memcpy lane from the device copies and memsets")] = True
    for g, verdict in sorted(job.stragglers.verdicts.items()):
        status[("stragglers", f"{g}: {verdict}")] = True
    for p in job.paths:
        if p.note:
            status[("critical_path", f"step {p.step}: {p.note}")] = False
    if job.paths and not any(p.note for p in job.paths):
        status[("critical_path", f"{len(job.paths)} steps")] = True


def _instances(job: TimeAnalysis, schemes: Mapping[str, str]) -> Columns:
    inst, st = job.match.instances, job.stats
    first = [
        None if last is None or skew is None else last - skew
        for last, skew in zip(st.last_arrival, st.skew_us, strict=True)
    ]
    return {
        "instance_id": list(range(len(inst))),
        "group_key": inst.group,
        "scheme": [schemes.get(g) for g in inst.group],
        "op": inst.op,
        "dtype": inst.dtype,
        "msg_bytes": inst.msg_bytes,
        "step": inst.step,
        "match_key": inst.key,
        "keyed_by": inst.keyed_by,
        "members": [len(m) for m in inst.member_rank],
        "first_arrival_ref_us": first,
        "last_arrival_ref_us": st.last_arrival,
        "last_rank": st.last_rank,
        "skew_us": st.skew_us,
        "real_us": st.real_us,
        "algbw_gbps": st.algbw_gbps,
        "busbw_gbps": st.busbw_gbps,
    }


def _members(job: TimeAnalysis, data: RunInput) -> Columns:
    inst, st, clocks = job.match.instances, job.stats, job.clocks
    source = {(r, s): src for r, d in data.ranks.items() for src, s in zip(d.calls.source_id, d.calls.seq, strict=True)}
    out: Columns = defaultdict(list)
    for k in range(len(inst)):
        for r, seq, a, e, w in zip(
            inst.member_rank[k],
            inst.member_seq[k],
            inst.member_arrival[k],
            inst.member_end[k],
            st.member_wait_us[k],
            strict=True,
        ):
            out["instance_id"].append(k)
            out["rank"].append(r)
            out["source_id"].append(source.get((r, seq)))
            out["seq"].append(seq)
            out["arrival_ref_us"].append(None if a is None else clocks.to_reference(r, a))
            out["end_ref_us"].append(None if e is None else clocks.to_reference(r, e))
            out["wait_us"].append(w)
    return _ensure(out, ("instance_id", "rank", "source_id", "seq", "arrival_ref_us", "end_ref_us", "wait_us"))


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
    n, m = len(b.rank), len(b.by_scheme)
    return {
        "rank": b.rank + [x[0] for x in b.by_scheme],
        "step": b.step + [x[1] for x in b.by_scheme],
        "scheme": [None] * n + [x[2] for x in b.by_scheme],
        "step_us": b.step_us + [None] * m,
        "compute_us": b.compute_us + [None] * m,
        "overlapped_us": b.overlapped_us + [x[3] for x in b.by_scheme],
        "wait_us": b.wait_us + [x[4] for x in b.by_scheme],
        "exposed_us": b.exposed_us + [x[5] for x in b.by_scheme],
        "memcpy_us": b.memcpy_us + [None] * m,
        "idle_us": b.idle_us + [None] * m,
    }


def _union_arrays(s: npt.NDArray[np.float64], e: npt.NDArray[np.float64]) -> tuple[npt.NDArray[np.float64], ...]:
    """Disjoint sorted intervals covering the given ones."""
    if not len(s):
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    return s[idx], reach[np.append(idx[1:], len(s)) - 1]


def _memcpy(data: RunInput) -> Columns:
    """Per rank, step and direction: bytes of the copies starting in the step, and the time that
    direction runs in the step (union over streams)."""
    out: Columns = defaultdict(list)
    for r in sorted(data.ranks):
        d = data.ranks[r]
        if not d.has_device or not d.steps.step:
            continue
        kind = np.asarray(d.intervals.kind, dtype=object)
        start = np.asarray(d.intervals.start, dtype=np.float64)
        end = np.asarray(d.intervals.end, dtype=np.float64)
        nbytes = np.asarray(d.intervals.nbytes, dtype=np.int64)
        t0s = np.asarray(d.steps.start, dtype=np.float64)
        t1s = np.asarray(d.steps.end, dtype=np.float64)
        for k in sorted(MEMORY_KINDS):
            sel = kind == k
            if not sel.any():
                continue
            us, ue = _union_arrays(start[sel], end[sel])
            order = np.argsort(start[sel], kind="stable")
            ks, kb = start[sel][order], np.concatenate([[0], np.cumsum(nbytes[sel][order])])
            moved = kb[np.searchsorted(ks, t1s, side="left")] - kb[np.searchsorted(ks, t0s, side="left")]
            # The union's pieces meeting the step are a run [lo, hi); the sum over all of them (zeros
            # elsewhere) is taken in numpy's order, as np.clip(...).sum() over the whole union gave it.
            lo = np.searchsorted(ue, t0s, side="right").tolist()
            hi = np.searchsorted(us, t1s, side="left").tolist()
            for j, (n, t0, t1) in enumerate(zip(d.steps.step, d.steps.start, d.steps.end, strict=True)):
                a, z = lo[j], max(hi[j], lo[j])
                busy = sparse_sum(
                    len(us), a, (np.minimum(ue[a:z], t1) - np.maximum(us[a:z], t0)).tolist() if z > a else []
                )
                b = int(moved[j])
                if busy <= 0 and b == 0:
                    continue
                out["rank"].append(r)
                out["step"].append(n)
                out["direction"].append(k.removeprefix("memcpy_"))
                out["bytes"].append(b)
                out["busy_us"].append(busy)
                out["gbps"].append(b / (busy * 1e3) if busy > 0 else None)
    return _ensure(out, ("rank", "step", "direction", "bytes", "busy_us", "gbps"))


def _rank_totals(job: TimeAnalysis, data: RunInput) -> Columns:
    t = rank_totals(job.match.instances, job.stats)
    imposed: dict[int, float] = defaultdict(float)
    for r, x in zip(job.stragglers.ranks.rank, job.stragglers.ranks.imposed_us, strict=True):
        imposed[r] += x
    b = job.breakdown
    per: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for r, step_us, wait, exposed, over in zip(
        b.rank, b.step_us, b.wait_us, b.exposed_us, b.overlapped_us, strict=True
    ):
        acc = per[r]
        acc[0] += step_us
        acc[1] += wait + exposed
        acc[2] += over
    known = dict(zip(t.rank, zip(t.instances, t.arrived_last, t.wait_us, strict=True), strict=True))
    ranks = sorted(data.ranks)
    return {
        "rank": ranks,
        "steps": [len(data.ranks[r].steps.step) for r in ranks],
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
