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

from collections import defaultdict
from typing import Literal

import duckdb

from commlens.contract.analysis import Imbalance, RankSchemeTotal, RankTotals
from commlens.store.aggregates import measured_kind_sql

from .iterations import fresh_run_id, iteration_info


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


def rank_totals(con: duckdb.DuckDBPyConnection, run: str) -> RankTotals:
    """Calls, bytes and measured time per rank and scheme, with max/mean imbalance per scheme."""
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
    return RankTotals(run=run, rows=out, imbalance=imbalance, notes=notes)
