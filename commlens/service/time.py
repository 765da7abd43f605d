"""Reads of a run's time analysis (docs/time.md): the rows the ingest computed into the `time_*` tables
(commlens/store/time.sql), shaped as the wire contract. Nothing is analysed here, so every answer costs
a few indexed reads, whatever the run's size.

Every function raises `UnknownRunError` (a LookupError) for a run that does not exist. A run without
time rows answers empty lists and a status whose `available` is false.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import duckdb

from commlens.backend.iterations import run_id_of
from commlens.backend.run_cache import cached
from commlens.contract.analysis import UNATTRIBUTED
from commlens.contract.time import (
    MAX_MEMBER_ROWS,
    OTHER_COMM,
    TIME_CATEGORIES,
    BreakdownBands,
    BreakdownReport,
    ClockOffsets,
    CriticalPath,
    CriticalPathReport,
    GroupVerdict,
    Instance,
    InstanceMember,
    InstancesPage,
    MemcpyLane,
    Mismatch,
    MismatchReport,
    PathSegment,
    RankArrivals,
    RankBand,
    RankOffset,
    RankTime,
    SchemeTime,
    StepBreakdown,
    StepRef,
    Straggler,
    StragglerReport,
    TimePart,
    TimeStatus,
    TimeSummary,
)
from commlens.service.errors import NotFoundError

Con = duckdb.DuckDBPyConnection


def _rows(con: Con, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    return con.execute(sql, params).fetchall()


def _next(offset: int, limit: int, total: int) -> int | None:
    return offset + limit if offset + limit < total else None


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1000.0


# ------------------------------------------------------------------------------------- summary


def status(con: Con, run_id: int) -> TimeStatus:
    parts = [
        TimePart(part=p, computed=ok, reason=r)
        for p, ok, r in _rows(
            con, "SELECT part, ok, reason FROM time_status WHERE run_id = ? ORDER BY part, ok DESC, reason", [run_id]
        )
    ]
    return TimeStatus(available=bool(parts), parts=parts)


def clocks(con: Con, run_id: int) -> ClockOffsets | None:
    rows = _rows(
        con,
        """SELECT rank, domain, offset_us, estimate_us, spread_us, instances, applied, trusted, reason
           FROM time_clock_offsets WHERE run_id = ? ORDER BY rank""",
        [run_id],
    )
    if not rows:
        return None
    return ClockOffsets(
        applied=rows[0][6],
        trusted=rows[0][7],
        reason=rows[0][8],
        offsets=[
            RankOffset(rank=r, domain=d, offset_us=o, estimate_us=e, spread_us=s, instances=n)
            for r, d, o, e, s, n, *_ in rows
        ],
    )


def rank_times(con: Con, run_id: int) -> list[RankTime]:
    return [
        RankTime(
            rank=r,
            steps=st,
            instances=n,
            arrived_last=last,
            wait_us=w,
            imposed_us=imp,
            step_us=step_us,
            exposed_us=exp,
            overlapped_us=ov,
        )
        for r, st, n, last, w, imp, step_us, exp, ov in _rows(
            con,
            """SELECT rank, steps, instances, arrived_last, wait_us, imposed_us, step_us, exposed_us, overlapped_us
               FROM time_rank_totals WHERE run_id = ? ORDER BY rank""",
            [run_id],
        )
    ]


def _verdicts(con: Con, run_id: int) -> tuple[list[Straggler], list[GroupVerdict]]:
    rows = _rows(
        con,
        """SELECT group_key, coalesce(scheme, ?), straggler, rank, candidate_rank, arrived_last_share,
                  steps_mostly_last, steps, imposed_us_per_step, instances, reason
           FROM time_stragglers WHERE run_id = ? ORDER BY group_key""",
        [UNATTRIBUTED, run_id],
    )
    named: list[Straggler] = []
    groups: list[GroupVerdict] = []
    for g, sc, is_straggler, rank, cand, share, mostly, steps, imposed, n, reason in rows:
        groups.append(
            GroupVerdict(
                group=g,
                scheme=sc,
                verdict="straggler" if is_straggler else "no straggler",
                reason=reason,
                candidate_rank=cand,
                arrived_last_share=share,
                steps_consistent=mostly,
                steps=steps,
                imposed_ms_per_step=_ms(imposed),
                instances=n,
            )
        )
        if is_straggler:
            named.append(
                Straggler(
                    rank=rank,
                    scheme=sc,
                    group=g,
                    arrived_last_share=share,
                    steps_consistent=mostly,
                    steps=steps,
                    imposed_ms_per_step=imposed / 1000.0,
                    instances=n,
                    reason=reason,
                )
            )
    return named, groups


def time_summary(con: Con, run: str) -> TimeSummary:
    """What was computed, the clocks, per-rank totals and the stragglers of a run."""
    run_id = run_id_of(con, run)
    named, groups = _verdicts(con, run_id)
    (n_inst,) = _rows(con, "SELECT count(*) FROM time_instances WHERE run_id = ?", [run_id])[0]
    (n_mis,) = _rows(con, "SELECT count(*) FROM time_mismatches WHERE run_id = ?", [run_id])[0]
    return TimeSummary(
        run=run,
        status=status(con, run_id),
        clocks=clocks(con, run_id),
        instances=n_inst,
        mismatches=n_mis,
        ranks=rank_times(con, run_id),
        stragglers=named,
        verdicts=groups,
    )


# ----------------------------------------------------------------------------------- breakdown


def breakdown(
    con: Con,
    run: str,
    rank: int | None = None,
    step: int | None = None,
    scheme: str | None = None,
    limit: int = 1000,
    offset: int = 0,
    first: int | None = None,
    last: int | None = None,
) -> BreakdownReport:
    """A page of (rank, step) rows with the six categories; `scheme` keeps only that scheme's split;
    `first`/`last` bound the ranks (a band of breakdown_bands)."""
    run_id = run_id_of(con, run)
    where, params = "run_id = ?", [run_id]
    if rank is not None:
        where, params = where + " AND rank = ?", [*params, rank]
    if first is not None:
        where, params = where + " AND rank >= ?", [*params, first]
    if last is not None:
        where, params = where + " AND rank <= ?", [*params, last]
    if step is not None:
        where, params = where + " AND step = ?", [*params, step]
    split: dict[tuple[int, int], list[SchemeTime]] = defaultdict(list)
    lanes: dict[tuple[int, int], list[MemcpyLane]] = defaultdict(list)
    if step is not None:
        # One step holds a row per rank and scheme, in one step block of the table (commlens/store/layout.py):
        # read them in one pass, count and page here.
        whole, split_rows = [], []
        for r, n, sc, t, c, ov, w, ex, m, i in _rows(
            con,
            f"""SELECT rank, step, scheme, step_us, compute_us, overlapped_us, wait_us, exposed_us, memcpy_us, idle_us
                FROM time_breakdown WHERE {where} ORDER BY rank, step, scheme NULLS FIRST""",
            params,
        ):
            if sc is None:
                whole.append((r, n, t, c, ov, w, ex, m, i))
            elif scheme is None or sc == scheme:
                split_rows.append((r, n, sc, ov, w, ex))
        total, whole = len(whole), whole[offset : offset + limit]
        keys = {(r, n) for r, n, *_ in whole}
        split_rows = [x for x in split_rows if (x[0], x[1]) in keys]
    else:
        (total,) = _rows(con, f"SELECT count(*) FROM time_breakdown WHERE {where} AND scheme IS NULL", params)[0]
        whole = _rows(
            con,
            f"""SELECT rank, step, step_us, compute_us, overlapped_us, wait_us, exposed_us, memcpy_us, idle_us
                FROM time_breakdown WHERE {where} AND scheme IS NULL ORDER BY rank, step LIMIT ? OFFSET ?""",
            [*params, limit, offset],
        )
    if whole:
        # the page's rows lie between its first and last (rank, step): one range for the split and the lanes;
        # the bounds on rank and on step alone are what the step-block layout prunes with
        lo, hi = (whole[0][0], whole[0][1]), (whole[-1][0], whole[-1][1])
        steps = [w[1] for w in whole]
        page = f"{where} AND rank BETWEEN ? AND ? AND step BETWEEN ? AND ? AND (rank, step) BETWEEN (?, ?) AND (?, ?)"
        bounds = [*params, lo[0], hi[0], min(steps), max(steps), *lo, *hi]
        if step is not None:  # the step's own block, not every step of the ranks in between
            page, bounds = f"{where} AND rank BETWEEN ? AND ?", [*params, lo[0], hi[0]]
        if step is None:
            split_rows = _rows(
                con,
                f"""SELECT rank, step, scheme, overlapped_us, wait_us, exposed_us FROM time_breakdown
                    WHERE {page} AND scheme IS NOT NULL {"AND scheme = ?" if scheme else ""}
                    ORDER BY rank, step, scheme""",
                bounds + ([scheme] if scheme else []),
            )
        for r, n, sc, ov, w, ex in split_rows:
            split[(r, n)].append(SchemeTime(scheme=sc, overlapped_us=ov, wait_us=w, exposed_us=ex))
        for r, n, d, b, busy, gbps in _rows(
            con,
            f"""SELECT rank, step, direction, bytes, busy_us, gbps FROM time_memcpy WHERE {page}
                ORDER BY rank, step, direction""",
            bounds,
        ):
            lanes[(r, n)].append(MemcpyLane(direction=d, bytes=b, busy_us=busy, gbps=gbps))
    rows = [
        StepBreakdown(
            rank=r,
            step=n,
            step_us=t,
            compute_us=c,
            overlapped_us=ov,
            wait_us=w,
            exposed_us=ex,
            memcpy_us=m,
            idle_us=i,
            schemes=split.get((r, n), []),
            memcpy=lanes.get((r, n), []),
        )
        for r, n, t, c, ov, w, ex, m, i in whole
    ]
    notes = _breakdown_notes(con, run_id)
    return BreakdownReport(
        run=run,
        filters={"rank": rank, "step": step, "scheme": scheme, "first": first, "last": last},
        rows=rows,
        total=total,
        limit=limit,
        offset=offset,
        next_offset=_next(offset, limit, total),
        notes=notes,
    )


# global ranks per band of breakdown_bands by default, wider where more than MAX_BANDS bands would be needed
BAND_RANKS = 32
MAX_BANDS = 32
SLOWEST_STEPS = 5  # the run's slowest (rank, step) rows breakdown_bands names


def band_width(top: int) -> int:
    """Global ranks per band when the highest rank is `top`: BAND_RANKS, or wider so that at most MAX_BANDS bands
    remain."""
    return max(BAND_RANKS, -(-(top + 1) // MAX_BANDS))


def breakdown_bands(con: Con, run: str, scheme: str | None = None, band: int | None = None) -> BreakdownBands:
    """The breakdown in bands of `band` consecutive global ranks (default band_width), aggregated in the store
    (a page of many ranks reads a few dozen rows, not ranks x steps) and kept per version of the run
    (backend/run_cache.py: an aggregate over every (rank, step) row)."""
    return cached(con, run, ("breakdown_bands", scheme, band), lambda: _breakdown_bands(con, run, scheme, band))


def _breakdown_bands(con: Con, run: str, scheme: str | None, band: int | None) -> BreakdownBands:
    run_id = run_id_of(con, run)
    ranks, rank_steps, top = _rows(
        con,
        "SELECT count(DISTINCT rank), count(*), max(rank) FROM time_breakdown WHERE run_id = ? AND scheme IS NULL",
        [run_id],
    )[0]
    band = band or band_width(top or 0)
    # with a scheme, its own split of each row (none in a step without its communication), else the row's own
    mine = [f"coalesce(s.{c}, 0)" if scheme else f"b.{c}" for c in ("overlapped_us", "wait_us", "exposed_us")]
    join = (
        "LEFT JOIN time_breakdown s ON s.run_id = b.run_id AND s.rank = b.rank AND s.step = b.step AND s.scheme = ?"
        if scheme
        else ""
    )
    rows = _rows(
        con,
        f"""WITH w AS (
                SELECT b.rank, b.step, b.step_us, b.compute_us, b.memcpy_us, b.idle_us,
                       b.overlapped_us + b.wait_us + b.exposed_us AS comm_us,
                       {mine[0]} AS ov, {mine[1]} AS wt, {mine[2]} AS ex
                FROM time_breakdown b {join} WHERE b.run_id = ? AND b.scheme IS NULL)
            SELECT rank // ? AS band, count(DISTINCT rank), count(*), avg(step_us),
                   avg(compute_us), avg(ov), avg(wt), avg(ex), avg(memcpy_us), avg(idle_us),
                   avg(greatest(comm_us - ov - wt - ex, 0)),
                   arg_min((rank, step, step_us), (step_us, rank, step)),
                   arg_max((rank, step, step_us), (step_us, -rank, -step))
            FROM w GROUP BY band ORDER BY band""",
        ([scheme] if scheme else []) + [run_id, band],
    )
    bands = []
    for b, n, k, step_us, *means, (fr, fs, fu), (sr, ss, su) in rows:
        categories = dict(zip(TIME_CATEGORIES, means[:6], strict=True))
        if scheme:
            categories[OTHER_COMM] = means[6]
        bands.append(
            RankBand(
                first=b * band,
                last=min(b * band + band - 1, top),
                ranks=n,
                rank_steps=k,
                step_us=step_us,
                categories=categories,
                fastest=StepRef(rank=fr, step=fs, step_us=fu),
                slowest=StepRef(rank=sr, step=ss, step_us=su),
            )
        )
    slowest = _rows(
        con,
        """SELECT rank, step, step_us FROM time_breakdown WHERE run_id = ? AND scheme IS NULL
           ORDER BY step_us DESC, rank, step LIMIT ?""",
        [run_id, SLOWEST_STEPS],
    )
    steps = _rows(
        con, "SELECT DISTINCT step FROM time_breakdown WHERE run_id = ? AND scheme IS NULL ORDER BY step", [run_id]
    )
    return BreakdownBands(
        run=run,
        scheme=scheme,
        ranks=ranks,
        rank_steps=rank_steps,
        steps=[s for (s,) in steps],
        band=band,
        bands=bands,
        slowest=[StepRef(rank=r, step=n, step_us=u) for r, n, u in slowest],
        notes=_breakdown_notes(con, run_id),
    )


def _breakdown_notes(con: Con, run_id: int) -> list[str]:
    """Why the breakdown is missing or partial."""
    return [p.reason for p in status(con, run_id).parts if p.part in ("breakdown", "memcpy") and not p.computed]


# ----------------------------------------------------------------------------------- instances


_INSTANCE_COLUMNS = """instance_id, group_key, coalesce(scheme, ?), match_key, keyed_by, op, dtype, msg_bytes, step,
    skew_us, last_rank, first_arrival_ref_us, last_arrival_ref_us, real_us, algbw_gbps, busbw_gbps, members"""


def _members(con: Con, run_id: int, ids: list[int]) -> dict[int, list[InstanceMember]]:
    """The members of the given instances, by instance."""
    members: dict[int, list[InstanceMember]] = defaultdict(list)
    if not ids:
        return members
    # instance ids of a page lie in [min, max]: a range the table's zone maps prune, then the page's own
    for k, r, seq, a, e, w in _rows(
        con,
        """SELECT instance_id, rank, seq, arrival_ref_us, end_ref_us, wait_us FROM time_instance_members
           WHERE run_id = ? AND instance_id BETWEEN ? AND ? AND list_contains(?, instance_id)
           ORDER BY instance_id, rank""",
        [run_id, min(ids), max(ids), ids],
    ):
        members[k].append(InstanceMember.model_construct(rank=r, seq=seq, arrival_us=a, end_us=e, wait_us=w))
    return members


def _instance(row: tuple[Any, ...], members: dict[int, list[InstanceMember]] | None) -> Instance:
    k, g, sc, key, how, o, dt, s, n, skew, last, first_a, last_a, real, alg, bus, count = row
    return Instance(
        instance_id=k,
        group=g,
        scheme=sc,
        key=key,
        keyed_by=how,
        op=o,
        dtype=dt,
        msg_bytes=s,
        step=n,
        skew_us=skew,
        last_rank=last,
        first_arrival_us=first_a,
        last_arrival_us=last_a,
        real_us=real,
        algbw_gbps=alg,
        busbw_gbps=bus,
        members=[] if members is None else members.get(k, []),
        member_count=count,
        members_included=members is not None,
    )


def instances(
    con: Con,
    run: str,
    group: str | None = None,
    op: str | None = None,
    step: int | None = None,
    rank: int | None = None,
    limit: int = 100,
    offset: int = 0,
    members: bool = True,
    max_members: int = MAX_MEMBER_ROWS,
) -> InstancesPage:
    """A page of the run's instances in instance order, each with its members unless `members` is false;
    filters combine. With members, the page stops before its member rows would pass `max_members` (it holds at
    least one instance), so a page's cost follows its rows, not the group size."""
    run_id = run_id_of(con, run)
    where = "i.run_id = ?"
    params: list[Any] = [run_id]
    for col, val in (("group_key", group), ("op", op), ("step", step)):
        if val is not None:
            where, params = f"{where} AND i.{col} = ?", [*params, val]
    if rank is not None:
        where += " AND i.instance_id IN (SELECT instance_id FROM time_instance_members WHERE run_id = ? AND rank = ?)"
        params += [run_id, rank]
    (total,) = _rows(con, f"SELECT count(*) FROM time_instances i WHERE {where}", params)[0]
    rows = _rows(
        con,
        f"SELECT {_INSTANCE_COLUMNS} FROM time_instances i WHERE {where} ORDER BY instance_id LIMIT ? OFFSET ?",
        [UNATTRIBUTED, *params, limit, offset],
    )
    if members:
        kept, rows_left = 0, max_members
        for row in rows:
            if kept and row[-1] > rows_left:
                break
            kept, rows_left = kept + 1, rows_left - row[-1]
        rows = rows[:kept]
    found = _members(con, run_id, [r[0] for r in rows]) if members else None
    return InstancesPage(
        run=run,
        filters={"group": group, "op": op, "step": step, "rank": rank},
        items=[_instance(r, found) for r in rows],
        total=total,
        limit=limit,
        offset=offset,
        next_offset=_next(offset, len(rows), total) if rows else None,
        max_members=max_members,
    )


def instance(con: Con, run: str, instance_id: int) -> Instance:
    """One instance with all its members, however many."""
    run_id = run_id_of(con, run)
    rows = _rows(
        con,
        f"SELECT {_INSTANCE_COLUMNS} FROM time_instances i WHERE run_id = ? AND instance_id = ?",
        [UNATTRIBUTED, run_id, instance_id],
    )
    if not rows:
        raise NotFoundError(f"run {run!r} has no instance {instance_id}", "unknown_instance")
    return _instance(rows[0], _members(con, run_id, [instance_id]))


def mismatches(con: Con, run: str) -> MismatchReport:
    run_id = run_id_of(con, run)
    found = [
        Mismatch(group=g, position=p, reason=why, rank_a=ra, side_a=sa, rank_b=rb, side_b=sb)
        for g, p, why, ra, sa, rb, sb in _rows(
            con,
            """SELECT group_key, position, reason, rank_a, side_a, rank_b, side_b FROM time_mismatches
               WHERE run_id = ? ORDER BY group_key, position, rank_b""",
            [run_id],
        )
    ]
    left = dict(
        _rows(con, "SELECT reason, calls FROM time_unmatched WHERE run_id = ? ORDER BY calls DESC, reason", [run_id])
    )
    return MismatchReport(run=run, mismatches=found, not_matched=left)


# ---------------------------------------------------------------------------------- stragglers


def stragglers(con: Con, run: str) -> StragglerReport:
    run_id = run_id_of(con, run)
    named, groups = _verdicts(con, run_id)
    ranks = [
        RankArrivals(
            group=g,
            scheme=sc,
            rank=r,
            instances=n,
            arrived_last=last,
            imposed_us=imp,
            wait_us=w,
            steps=st,
            steps_mostly_last=mostly,
        )
        for g, sc, r, n, last, imp, w, st, mostly in _rows(
            con,
            """SELECT group_key, coalesce(scheme, ?), rank, instances, arrived_last, imposed_us, wait_us, steps,
                      steps_mostly_last
               FROM time_arrivals WHERE run_id = ? ORDER BY group_key, rank""",
            [UNATTRIBUTED, run_id],
        )
    ]
    return StragglerReport(run=run, stragglers=named, groups=groups, ranks=ranks)


# ------------------------------------------------------------------------------- critical path


def critical_paths(con: Con, run: str, step: int | None = None, with_segments: bool = True) -> CriticalPathReport:
    """Each step's critical path (or one step's), its segments latest first (without them: their count only, which
    costs a small part at thousands of steps)."""
    run_id = run_id_of(con, run)
    where, params = "run_id = ?", [run_id]
    if step is not None:
        where, params = where + " AND step = ?", [*params, step]
    segments: dict[int, list[PathSegment]] = defaultdict(list)
    counts: dict[int, int]
    if with_segments:
        for n, r, s, e, kind, k in _rows(
            con,
            f"""SELECT step, rank, start_ref_us, end_ref_us, kind, instance_id FROM time_critical_segments
                WHERE {where} ORDER BY step, seg""",
            params,
        ):
            segments[n].append(PathSegment(rank=r, start_us=s, end_us=e, kind=kind, instance_id=k))
        counts = {n: len(v) for n, v in segments.items()}
    else:
        counts = dict(
            _rows(con, f"SELECT step, count(*) FROM time_critical_segments WHERE {where} GROUP BY step", params)
        )
    shares: dict[int, dict[str, float]] = defaultdict(dict)
    for n, sc, share in _rows(
        con,
        f"SELECT step, scheme, exposed_share FROM time_critical_schemes WHERE {where} ORDER BY step, scheme",
        params,
    ):
        shares[n][sc] = share
    paths = [
        CriticalPath(
            step=n,
            start_us=s,
            end_us=e,
            segments=segments.get(n, []),
            segment_count=counts.get(n, 0),
            segments_included=with_segments,
            categories={
                "compute": c or 0.0,
                "overlapped": ov or 0.0,
                "wait": w or 0.0,
                "exposed": ex or 0.0,
                "memcpy": m or 0.0,
                "idle": i or 0.0,
            },
            exposed_share_by_scheme=shares.get(n, {}),
            note=note,
        )
        for n, s, e, c, ov, w, ex, m, i, note in _rows(
            con,
            f"""SELECT step, start_ref_us, end_ref_us, compute_us, overlapped_us, wait_us, exposed_us, memcpy_us,
                       idle_us, note
                FROM time_critical_path WHERE {where} ORDER BY step""",
            params,
        )
    ]
    return CriticalPathReport(run=run, paths=paths)
