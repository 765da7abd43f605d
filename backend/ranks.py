"""Per-rank communication totals per scheme, and how unevenly the ranks carry them.

Totals count every call; per-iteration values count only calls inside complete iterations (profiler
steps or the detected period) divided by the rank's iterations, so ranks that captured different
numbers of steps compare fairly. Imbalance uses per-iteration values when every rank involved has
profiler steps (or the same detected iteration count), else totals; per scheme it looks at the ranks
that use the scheme, overall at all ranks.
Time is the sum of measured durations only (kernel time or gloo CPU time), and is left out when a
rank involved has none. Read from the run's aggregates (comm_agg joined to its groups' schemes).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Literal

import duckdb

from commlens.contract.analysis import (
    Imbalance,
    RankBasis,
    RankGroup,
    RankGroupCell,
    RankMetric,
    RankSchemeTotal,
    RankSummary,
    RankTotals,
    RankValue,
    SchemeSpread,
)
from commlens.store.aggregates import measured_kind_sql

from .iterations import fresh_run_id, iteration_info


def process_keys(con: duckdb.DuckDBPyConnection, run_id: int) -> set[str]:
    """The rank keys of the run's calls that are processes, not global ranks: calls whose file names no rank
    (an NCCL log's "host:pid" lines, a trace without distributedInfo, keyed by its file). Every view keyed by
    rank (histograms' n_ranks, these totals) counts them beside the global ranks; the run's own `ranks`
    (run detail) counts global ranks only."""
    rows = con.execute("SELECT DISTINCT rank_key FROM comm_agg WHERE run_id = ? AND rank IS NULL", [run_id]).fetchall()
    return {str(r[0]) for r in rows}


def processes_note(processes: int, keys: int, counted: str) -> str | None:
    """The note a view keyed by rank carries when `processes` of its `keys` are processes without a global rank
    (None when there are none): what they are, and that the run's rank count leaves them out."""
    if not processes:
        return None
    which = "all" if processes == keys else f"{processes:,} of the {keys:,}"
    return (
        f"{which} {counted} are processes without a global rank (their files name none; keyed by host:pid or by "
        "file): the run's count of ranks counts global ranks only, so it leaves them out"
    )


def _rank_order(key: str) -> tuple[int, int | str]:
    return (0, int(key)) if key.lstrip("-").isdigit() else (1, key)


def _imbalance(
    scheme: str | None,
    metric: Literal["bytes", "time_us"],
    values: dict[str, float],
    basis: Literal["per_iteration", "total"],
    overall: bool,
) -> Imbalance | None:
    if len(values) < 2:
        return None
    mean = sum(values.values()) / len(values)
    if mean <= 0:
        return None
    hi = max(values, key=lambda r: values[r])
    lo = min(values, key=lambda r: values[r])
    return Imbalance(
        all_schemes=overall,
        scheme=scheme,
        metric=metric,
        basis=basis,
        ranks=len(values),
        max=values[hi],
        mean=mean,
        max_over_mean=values[hi] / mean,
        max_rank=hi,
        min_rank=lo,
    )


def rank_totals(
    con: duckdb.DuckDBPyConnection, run: str, first: int | None = None, last: int | None = None
) -> RankTotals:
    """Calls, bytes and measured time per rank and scheme, with max/mean imbalance per scheme; given a range,
    the rows of the global ranks in [first, last] only (the imbalance still spans every rank)."""
    run_id = fresh_run_id(con, run)
    info = iteration_info(con, run, run_id)
    measured = measured_kind_sql("a", "g")
    rows = con.execute(
        f"""
        SELECT a.rank_key, g.scheme, sum(a.calls), coalesce(sum(cast(a.msg_bytes AS HUGEINT) * a.calls), 0),
               sum(a.sum_dur_us) FILTER (WHERE {measured}),
               coalesce(sum(cast(a.msg_bytes AS HUGEINT) * a.calls) FILTER (WHERE a.in_iteration), 0),
               sum(a.sum_dur_us) FILTER (WHERE a.in_iteration AND {measured})
        FROM comm_agg a LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
        WHERE a.run_id = ?
        GROUP BY a.rank_key, g.scheme
        """,
        [run_id],
    ).fetchall()
    iterations = info.iterations
    out: list[RankSchemeTotal] = []
    for rk, scheme, calls, nbytes, time_us, it_bytes, it_time in rows:
        n = iterations.get(rk)
        out.append(
            RankSchemeTotal(
                rank=rk,
                scheme=scheme,
                calls=calls,
                bytes=int(nbytes),
                time_us=time_us,
                iterations=n,
                bytes_per_iteration=it_bytes / n if n else None,
                time_us_per_iteration=(it_time / n if it_time is not None else None) if n else None,
            )
        )
    out.sort(key=lambda r: (_rank_order(r.rank), r.scheme or "~"))

    notes: list[str] = []
    by_scheme: dict[str | None, list[RankSchemeTotal]] = defaultdict(list)
    for r in out:
        by_scheme[r.scheme].append(r)
    imbalance: list[Imbalance] = []
    scopes: list[tuple[str | None, list[RankSchemeTotal], bool]] = [(s, rs, False) for s, rs in by_scheme.items()]
    scopes.append((None, out, True))
    for scheme, rs, overall in scopes:
        counts = {r.rank: r.iterations for r in rs}
        # Detected iterations of a rank grow with its calls when the pattern is short, so they only
        # normalise when every rank found the same count; profiler steps always do.
        per_it = all(counts.values()) and (info.mode == "steps" or len(set(counts.values())) == 1)
        basis: Literal["per_iteration", "total"] = "per_iteration" if per_it else "total"
        bytes_by: dict[str, float] = defaultdict(float)
        time_by: dict[str, float] = defaultdict(float)
        missing_time = False
        for r in rs:
            bytes_by[r.rank] += (r.bytes_per_iteration or 0.0) if per_it else r.bytes
            t = r.time_us_per_iteration if per_it else r.time_us
            if t is None:
                missing_time = True
            else:
                time_by[r.rank] += t
        label = "all schemes" if overall else scheme or "unattributed"
        by_metric: dict[Literal["bytes", "time_us"], dict[str, float]] = {"bytes": bytes_by}
        if not missing_time:
            by_metric["time_us"] = time_by
        for metric, values in by_metric.items():
            imb = _imbalance(None if overall else scheme, metric, dict(values), basis, overall)
            if imb is not None:
                imbalance.append(imb)
        if not per_it and len(counts) > 1 and info.mode != "none":
            notes.append(f"{label}: iterations unknown or unequal across ranks, imbalance uses totals")
    imbalance.sort(key=lambda i: -i.max_over_mean)
    keys = {r.rank for r in out}
    n_ranks = len(keys)
    n_processes = len(keys & process_keys(con, run_id))
    if note := processes_note(n_processes, n_ranks, "ranks of these rows"):
        notes.append(note)
    if first is not None or last is not None:
        lo = first if first is not None else 0
        hi = last if last is not None else 2**63
        out = [r for r in out if r.rank.lstrip("-").isdigit() and lo <= int(r.rank) <= hi]
    return RankTotals(
        run=run,
        rows=out,
        imbalance=imbalance,
        notes=notes,
        ranks=n_ranks,
        n_processes=n_processes,
        first=first,
        last=last,
    )


def rank_value(r: RankSchemeTotal, metric: RankMetric, basis: RankBasis) -> float | None:
    """The number a rank's row contributes to a view of `metric` on `basis`."""
    if metric == "bytes":
        return r.bytes_per_iteration if basis == "per_iteration" else float(r.bytes)
    return r.time_us_per_iteration if basis == "per_iteration" else r.time_us


OUTLIER_LIMIT = 32


def _spread(scheme: str | None, values: dict[str, float]) -> SchemeSpread:
    ordered = sorted(values.values())
    q1, median, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    lo_fence, hi_fence = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
    outside = [(rk, v) for rk, v in values.items() if v < lo_fence or v > hi_fence]
    outside.sort(key=lambda p: (-abs(p[1] - median), _rank_order(p[0])))
    return SchemeSpread(
        scheme=scheme,
        ranks=len(values),
        min=ordered[0],
        q1=q1,
        median=median,
        q3=q3,
        max=ordered[-1],
        mean=sum(ordered) / len(ordered),
        min_rank=min(values, key=lambda rk: (values[rk], _rank_order(rk))),
        max_rank=min(values, key=lambda rk: (-values[rk], _rank_order(rk))),
        outliers=[RankValue(rank=rk, value=v) for rk, v in outside[:OUTLIER_LIMIT]],
        outliers_total=len(outside),
    )


def _group_of(rank: str, band: int) -> tuple[str, int | str]:
    """("band", index) for a global rank; ("host", name) for a process key "host:pid"."""
    if rank.lstrip("-").isdigit():
        return "band", int(rank) // band
    return "host", rank.rsplit(":", 1)[0]


def rank_summary(
    con: duckdb.DuckDBPyConnection,
    run: str,
    metric: RankMetric = "bytes",
    basis: RankBasis = "per_iteration",
    band: int = 32,
) -> RankSummary:
    """Per-rank values of `metric` on `basis` summarised for many ranks: the spread and outliers per scheme,
    and per band of `band` consecutive global ranks (or per host for processes without a rank) the mean,
    minimum and maximum per scheme with the ranks that hold them."""
    totals = rank_totals(con, run)
    by_scheme: dict[str | None, dict[str, float]] = defaultdict(dict)
    cells: dict[tuple[str, int | str], dict[str | None, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    members: dict[tuple[str, int | str], set[str]] = defaultdict(set)
    missing = 0
    for r in totals.rows:
        key = _group_of(r.rank, band)
        members[key].add(r.rank)
        v = rank_value(r, metric, basis)
        if v is None:
            missing += 1
            continue
        by_scheme[r.scheme][r.rank] = v
        cells[key][r.scheme][r.rank] = v
    schemes = sorted(by_scheme, key=lambda s: s or "~")
    groups: list[RankGroup] = []
    for key in sorted(members, key=lambda k: (k[0] == "host", str(k[1]) if k[0] == "host" else int(k[1]))):
        kind, ident = key
        group_cells = []
        for s in schemes:
            vals = cells[key].get(s)
            if not vals:
                continue
            group_cells.append(
                RankGroupCell(
                    scheme=s,
                    ranks=len(vals),
                    mean=sum(vals.values()) / len(vals),
                    min=min(vals.values()),
                    max=max(vals.values()),
                    min_rank=min(vals, key=lambda rk: (vals[rk], _rank_order(rk))),
                    max_rank=min(vals, key=lambda rk: (-vals[rk], _rank_order(rk))),
                )
            )
        if kind == "band":
            lo = int(ident) * band
            hi = min(lo + band - 1, max(int(r) for r in members[key]))  # an 8-rank run's band is ranks 0-7
            groups.append(
                RankGroup(
                    label=f"ranks {lo}-{hi}",
                    kind="band",
                    first=lo,
                    last=hi,
                    members=len(members[key]),
                    cells=group_cells,
                )
            )
        else:
            groups.append(
                RankGroup(
                    label=str(ident), kind="host", first=None, last=None, members=len(members[key]), cells=group_cells
                )
            )
    notes = list(totals.notes)
    if missing:
        what = "measured time" if metric == "time_us" else "bytes"
        per = " per iteration (no iterations known)" if basis == "per_iteration" else ""
        notes.append(f"{missing} rank and scheme rows have no {what}{per} and are left out")
    return RankSummary(
        run=run,
        metric=metric,
        basis=basis,
        band=band,
        ranks=totals.ranks,
        outlier_limit=OUTLIER_LIMIT,
        schemes=[_spread(s, by_scheme[s]) for s in schemes],
        groups=groups,
        notes=notes,
    )
