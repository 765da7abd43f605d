"""Timing findings: exposed communication per scheme, memcpy that no compute overlaps, a persistent
straggler (by arrival, never by time inside collectives) and collectives whose wait dominates their
duration. They read per-rank sums that the ingest service stores after the time tables
(`store_timing_inputs`), never the run's (rank, step) cells or member rows.

The same data give the same findings: a timing finding is raised only when its evidence is stable
(`_noise`). A spread across steps needs MIN_STEPS steps; with fewer, the ranks are the only replicates
and a finding needs MIN_RANKS ranks that each show at least MIN_TIME_SHARE of their step, else it is
"too few profiled steps to tell". The effect's mean less STANDARD_ERRORS standard errors (its spread
across steps within a rank over the root of the steps; on fewer steps, across ranks) must still reach
MIN_TIME_SHARE of the mean step (`short_of_floor`), so that an effect near the floor, or one that a
loaded host makes come and go step by step, stays silent. (A test of the per-step spread against the
effect, as the straggler rule has, flipped between two identical gloo runs of 8 profiled steps: 7.3 ms
and 18.6 ms of spread on 17.7 and 27.7 ms of exposed communication; the standard error decides both.) Severity scales with the cost (share of
the mean step) and drops a level on thin evidence (under STRONG_STEPS steps or a single rank). Each
finding states its stability (steps, ranks, spread, standard error) in its evidence and in words.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import fsum, sqrt
from statistics import fmean, stdev

import duckdb

from commlens.contract.analysis import Finding, Severity
from commlens.store import transaction
from commlens.store.tables import TIME_FINDING_TABLES

from .findings_common import STEPS_SQL, dur, pct, severity_from
from .timing.stragglers import DEFAULT_RULE

# A spread across steps needs MIN_STEPS steps (the straggler rule's min_steps); with fewer, a finding needs
# MIN_RANKS ranks that each show it. Every finding's mean less STANDARD_ERRORS standard errors must reach
# MIN_TIME_SHARE of the mean step; STRONG_STEPS steps on 2+ ranks keep the severity.
MIN_STEPS = DEFAULT_RULE.min_steps
MIN_RANKS = 8
STANDARD_ERRORS = 3.0
STRONG_STEPS = 4
MIN_TIME_SHARE = 0.05
WAIT_DOMINATES = 0.5  # a collective's members spend at least this share of their time in it waiting
TOP_INSTANCES = 20  # instance ids a finding links to (the largest skews first)


def _time_severity(share: float, steps: int, ranks: int) -> Severity | None:
    """Severity from the cost (share of the step), one level lower on thin evidence."""
    sev = severity_from(share, 0.25, 0.10, MIN_TIME_SHARE)
    if sev is None:
        return None
    if steps < STRONG_STEPS or ranks < 2:
        return "medium" if sev == "high" else "low"
    return sev


@dataclass(frozen=True)
class _Rank:
    """One rank's (rank, step) cells of a quantity, summarised at ingest (time_finding_cells)."""

    cells: int
    value_us: float  # the cells' values summed
    m2: float  # squared deviations from the rank's mean value, summed
    step_us: float  # the cells' step times summed
    weak: bool  # some cell is under MIN_TIME_SHARE of its step


@dataclass
class _Cells:
    """A quantity's values per (rank, step), as per-rank sums: a request reads O(ranks) numbers, not the
    run's cells. `steps` reads the sorted steps the cells span (only for a finding that is raised)."""

    ranks: dict[int, _Rank]
    n_steps: int
    steps: Callable[[], list[int]]

    def per_rank(self) -> dict[int, float]:
        return {r: x.value_us / x.cells for r, x in sorted(self.ranks.items())}

    def count(self) -> int:
        return sum(x.cells for x in self.ranks.values())

    def mean(self) -> float:
        return fsum(x.value_us for x in self.ranks.values()) / self.count()

    def mean_step(self) -> float:
        return fsum(x.step_us for x in self.ranks.values()) / self.count()

    def spread(self) -> float:
        """The spread across steps within a rank (the root of the ranks' mean variance): ranks differ by
        design (the one waited for waits least), so only each rank's own variation is noise."""
        return sqrt(fmean([x.m2 / (x.cells - 1) for x in self.ranks.values() if x.cells > 1] or [0.0]))

    def rank_spread(self) -> float:
        """The standard deviation of the ranks' means (0 on one rank)."""
        per_rank = list(self.per_rank().values())
        return stdev(per_rank) if len(per_rank) > 1 else 0.0

    def across_steps(self) -> bool:
        """Whether there are steps enough to measure a spread across them (MIN_STEPS)."""
        return self.n_steps >= MIN_STEPS

    def standard_error(self) -> float:
        """The standard error of the mean: over the steps (ranks share each step's noise, so they are not
        counted as replicates), else over the ranks when the steps are too few to tell."""
        if self.across_steps():
            return self.spread() / sqrt(self.n_steps)
        return self.rank_spread() / sqrt(len(self.ranks))

    def evidence(self) -> dict[str, float | int | str | None]:
        """The finding's stability as evidence: steps, ranks, spreads and the standard error (µs)."""
        return {
            "steps": self.n_steps,
            "ranks": len(self.ranks),
            "spread_across_steps_us": self.spread() if self.across_steps() else None,
            "spread_across_ranks_us": self.rank_spread() if len(self.ranks) > 1 else None,
            "standard_error_us": self.standard_error(),
        }


def _noise(cells: _Cells) -> str | None:
    """Why a timing finding's values are not evidence (module doc); None when they are."""
    n_steps, ranks, mean = cells.n_steps, len(cells.ranks), cells.mean()
    if mean <= 0:
        return "no effect"
    if not cells.across_steps():
        if ranks < MIN_RANKS:
            return (
                f"too few profiled steps to tell: {n_steps} step(s) on {ranks} rank(s); a spread across steps "
                f"needs {MIN_STEPS} steps (or {MIN_RANKS} ranks that each show it)"
            )
        weak = [r for r, x in sorted(cells.ranks.items()) if x.weak]
        if weak:
            return f"too few profiled steps to tell, and ranks {weak} show under {pct(MIN_TIME_SHARE)} of a step"
    return short_of_floor(mean, cells.standard_error(), cells.mean_step())


def short_of_floor(mean_us: float, standard_error_us: float, mean_step_us: float | None) -> str | None:
    """Why an effect is not well above the floor (its mean less STANDARD_ERRORS standard errors under
    MIN_TIME_SHARE of the mean step); None when it is."""
    floor = MIN_TIME_SHARE * (mean_step_us or 0.0)
    if mean_us - STANDARD_ERRORS * standard_error_us >= floor and mean_us > 0:
        return None
    return (
        f"{dur(mean_us)} less {STANDARD_ERRORS:g} standard errors of {dur(standard_error_us)} is under "
        f"{pct(MIN_TIME_SHARE)} of the step ({dur(floor)})"
    )


def _stability(cells: _Cells) -> str:
    """Mean ± the spread across steps within a rank, the standard error, and the range across ranks."""
    per_rank = cells.per_rank()
    se = f"standard error {dur(cells.standard_error())}"
    if cells.n_steps == 1:  # only the ranks say how stable it is
        text = f"one profiled step (stability across steps unknown): {dur(cells.mean())}"
    elif not cells.across_steps():
        text = f"{cells.n_steps} profiled steps (too few to tell their spread): {dur(cells.mean())}"
    else:
        text = f"{dur(cells.mean())} ± {dur(cells.spread())} per step over {cells.n_steps} steps, {se}"
    if len(per_rank) > 1:
        lo, hi = min(per_rank, key=lambda r: (per_rank[r], r)), max(per_rank, key=lambda r: (per_rank[r], -r))
        text += f"; {dur(per_rank[lo])} (rank {lo}) to {dur(per_rank[hi])} (rank {hi}) across {len(per_rank)} ranks"
        if not cells.across_steps():
            text += f", {se} across them"
    return text


# ---------------------------------------------------------------------------- timing inputs at ingest

# The cells of each timing finding's quantity, (key, op, rank, step, step_us, v, dur) per (rank, step):
# the breakdown's cells are every (rank, step) with a step time, a scheme absent from one counting 0 there;
# the waits' cells are the instance members' waits, against the mean step.
_WHOLE = """
    whole AS (
        SELECT rank, step, step_us, memcpy_us FROM time_breakdown
        WHERE run_id = $run AND scheme IS NULL AND step_us > 0
    )"""
_SCHEME_CELLS = (
    _WHOLE
    + """, schemes AS (SELECT DISTINCT scheme FROM time_breakdown WHERE run_id = $run AND scheme IS NOT NULL),
    cells AS (
        SELECT s.scheme AS key, '' AS op, w.rank, w.step, w.step_us, coalesce({column}, 0) AS v, NULL::DOUBLE AS dur
        FROM schemes s CROSS JOIN whole w
        LEFT JOIN time_breakdown b ON b.run_id = $run AND b.scheme = s.scheme AND b.rank = w.rank AND b.step = w.step
    )"""
)
_CELLS = {
    "exposed": _SCHEME_CELLS.format(column="b.wait_us + b.exposed_us"),
    "wait": _SCHEME_CELLS.format(column="b.wait_us"),
    "memcpy": _WHOLE
    + """, cells AS (
        SELECT '' AS key, '' AS op, rank, step, step_us, coalesce(memcpy_us, 0) AS v, NULL::DOUBLE AS dur FROM whole
    )""",
    # the wait of every member but the straggler, per group with one
    "straggler": """
    cells AS (
        SELECT i.group_key AS key, '' AS op, m.rank, i.step, $mean::DOUBLE AS step_us, sum(m.wait_us) AS v,
               NULL::DOUBLE AS dur
        FROM time_stragglers t
        JOIN time_instances i ON i.run_id = t.run_id AND i.group_key = t.group_key
        JOIN time_instance_members m ON m.run_id = i.run_id AND m.instance_id = i.instance_id
        WHERE t.run_id = $run AND t.straggler AND m.wait_us IS NOT NULL AND m.rank IS DISTINCT FROM t.rank
        GROUP BY i.group_key, m.rank, i.step
    )""",
    "wait_dominated": """
    cells AS (
        SELECT coalesce(i.scheme, 'unattributed') AS key, i.op, m.rank, i.step, $mean::DOUBLE AS step_us,
               sum(m.wait_us) AS v, sum(m.end_ref_us - m.arrival_ref_us) AS dur
        FROM time_instances i
        JOIN time_instance_members m ON m.run_id = i.run_id AND m.instance_id = i.instance_id
        WHERE i.run_id = $run AND m.wait_us IS NOT NULL AND m.end_ref_us IS NOT NULL AND i.step IS NOT NULL
        GROUP BY ALL
    )""",
}


def store_timing_inputs(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Summarise the run's time tables into what its timing findings read (time_finding_cells per kind,
    key and rank; time_finding_keys per kind and key; time_finding_runs: its steps and memcpy totals),
    replacing the run's rows in one transaction. A findings request then reads O(keys x ranks) rows
    instead of every (rank, step) cell and member row: call it after every write of the time tables
    (commlens.backend.timing.persist.persist_run)."""

    def write(c: duckdb.DuckDBPyConnection) -> None:
        for table in TIME_FINDING_TABLES:
            c.execute(f"DELETE FROM {table} WHERE run_id = $run", {"run": run_id})
        c.execute(
            f"""
            INSERT INTO time_finding_runs
            WITH s AS ({STEPS_SQL}), m AS (
                SELECT direction, sum(bytes) AS b, sum(busy_us) AS busy FROM time_memcpy WHERE run_id = $run
                GROUP BY direction
            )
            SELECT $run, s.*,
                   (SELECT b FROM m WHERE direction = 'htod'), (SELECT busy FROM m WHERE direction = 'htod'),
                   (SELECT b FROM m WHERE direction = 'dtoh'), (SELECT busy FROM m WHERE direction = 'dtoh')
            FROM s
            """,
            {"run": run_id},
        )
        mean_step = c.execute(
            "SELECT avg(step_us) FROM time_breakdown WHERE run_id = ? AND scheme IS NULL AND step_us > 0", [run_id]
        ).fetchall()[0][0]
        for kind, cells in _CELLS.items():
            params = {"run": run_id, "kind": kind, "share": MIN_TIME_SHARE} | (
                {"mean": mean_step} if "$mean" in cells else {}
            )
            c.execute(
                f"""
                INSERT INTO time_finding_cells
                WITH {cells}
                SELECT $run, $kind, key, op, rank, count(*), fsum(v), coalesce(var_pop(v), 0) * count(*),
                       fsum(step_us), coalesce(bool_or(v < $share * step_us), false), fsum(dur)
                FROM cells GROUP BY key, op, rank
                """,
                params,
            )
            c.execute(
                f"""
                INSERT INTO time_finding_keys (run_id, kind, key, op, n_steps, steps)
                WITH {cells}
                SELECT $run, $kind, key, op, count(DISTINCT step), list(DISTINCT step ORDER BY step)
                FROM cells GROUP BY key, op
                """,
                {"run": run_id, "kind": kind} | ({"mean": mean_step} if "$mean" in cells else {}),
            )
        # the instances each finding links (the largest skews first); the rank that caused most of a
        # collective's wait by arriving last, net of waits it inherited from other groups (stragglers.py)
        c.execute(
            """
            UPDATE time_finding_keys k SET top_instances = s.ids FROM (
                SELECT t.group_key, list(i.instance_id ORDER BY i.skew_us DESC NULLS LAST, i.instance_id)[:$top] AS ids
                FROM time_stragglers t
                JOIN time_instances i ON i.run_id = t.run_id AND i.group_key = t.group_key AND i.last_rank = t.rank
                WHERE t.run_id = $run AND t.straggler GROUP BY t.group_key
            ) s
            WHERE k.run_id = $run AND k.kind = 'straggler' AND k.key = s.group_key
            """,
            {"run": run_id, "top": TOP_INSTANCES},
        )
        c.execute(
            """
            UPDATE time_finding_keys k
            SET instances = s.n, top_instances = s.ids, cause_rank = w.last_rank, cause_wait_us = w.w
            FROM (
                SELECT coalesce(scheme, 'unattributed') AS key, op, count(*) AS n,
                       list(instance_id ORDER BY skew_us DESC NULLS LAST, instance_id)[:$top] AS ids
                FROM time_instances WHERE run_id = $run GROUP BY ALL
            ) s LEFT JOIN (
                SELECT key, op, first(last_rank ORDER BY w DESC, last_rank) AS last_rank, max(w) AS w FROM (
                    SELECT coalesce(scheme, 'unattributed') AS key, op, last_rank, sum(last_own_us) AS w
                    FROM time_instances WHERE run_id = $run AND last_own_us IS NOT NULL GROUP BY ALL
                ) GROUP BY key, op
            ) w ON w.key = s.key AND w.op = s.op
            WHERE k.run_id = $run AND k.kind = 'wait_dominated' AND k.key = s.key AND k.op = s.op
            """,
            {"run": run_id, "top": TOP_INSTANCES},
        )

    transaction(con, write)


@dataclass(frozen=True)
class _Key:
    """One key's row of time_finding_keys besides its steps."""

    n_steps: int
    instances: int | None
    top_instances: list[int]
    cause_rank: int | None
    cause_wait_us: float | None


class _Inputs:
    """The run's timing-finding inputs, read once per request."""

    def __init__(self, con: duckdb.DuckDBPyConnection, run_id: int) -> None:
        self.con, self.run_id = con, run_id
        self.ranks: dict[tuple[str, str, str], dict[int, _Rank]] = {}
        self.dur: dict[tuple[str, str, str], float] = {}
        for kind, key, op, rank, n, value, m2, step, weak, d in con.execute(
            """
            SELECT kind, key, op, rank, cells, value_us, m2_us2, step_us, weak, dur_us
            FROM time_finding_cells WHERE run_id = ? ORDER BY kind, key, op, rank
            """,
            [run_id],
        ).fetchall():
            self.ranks.setdefault((kind, key, op), {})[rank] = _Rank(n, value, m2, step or 0.0, weak)
            self.dur[(kind, key, op)] = self.dur.get((kind, key, op), 0.0) + (d or 0.0)
        self.keys = {
            (kind, key, op): _Key(n, inst, list(top or []), cause, cause_w)
            for kind, key, op, n, inst, top, cause, cause_w in con.execute(
                """
                SELECT kind, key, op, n_steps, instances, top_instances, cause_rank, cause_wait_us
                FROM time_finding_keys WHERE run_id = ?
                """,
                [run_id],
            ).fetchall()
        }

    def of(self, kind: str) -> list[tuple[str, str]]:
        """The (key, op) pairs of a kind, in order."""
        return sorted({(key, op) for k, key, op in self.ranks if k == kind})

    def cells(self, kind: str, key: str, op: str = "") -> _Cells | None:
        ranks = self.ranks.get((kind, key, op))
        if not ranks:
            return None

        def steps() -> list[int]:
            row = self.con.execute(
                "SELECT steps FROM time_finding_keys WHERE run_id = ? AND kind = ? AND key = ? AND op = ?",
                [self.run_id, kind, key, op],
            ).fetchall()[0]
            return list(row[0])

        return _Cells(ranks, self.keys[(kind, key, op)].n_steps, steps)


_SUGGEST_EXPOSED = {
    "dp": "Overlap the gradient reduction with the backward: DDP/FSDP buckets that fill earlier (a smaller "
    "first bucket, bucket_cap_mb), no_sync during accumulation, and no host synchronisation (loss.item(), "
    "gradient clipping on the host) between backward and the optimizer step.",
    "tp": "Tensor-parallel collectives sit on the critical path by design: overlap them with the next GEMM "
    "(sequence parallelism with communication overlap, async tensor parallel), or keep the tp group inside "
    "a node so each call is short.",
    "pp": "Pipeline sends and receives exposed mean bubbles: more micro-batches per step, an interleaved "
    "schedule, or batched point-to-point (batch_isend_irecv) posted before the compute they feed.",
    "cp": "Overlap the ring exchange of KV blocks with attention on the block already here.",
    "ep": "Overlap the token dispatch with the shared-expert or attention compute, and balance the routing.",
}


def _timed(
    fid: str,
    title: str,
    cells: _Cells,
    evidence: dict[str, float | int | str | None],
    view: dict[str, str | int | None],
    suggestion: str,
    instances: list[int] | None = None,
) -> Finding | None:
    """A timing finding from per-(rank, step) costs (µs), or None below the threshold or on noise."""
    if not cells.ranks or _noise(cells) is not None:
        return None
    per_rank = cells.per_rank()
    share = cells.mean() / cells.mean_step()
    severity = _time_severity(share, cells.n_steps, len(per_rank))
    if severity is None:
        return None
    return Finding(
        id=fid,
        title=title.format(ms=dur(cells.mean()), share=pct(share)),
        severity=severity,
        impact=min(share, 1.0),
        evidence=evidence
        | {"ms_per_step": cells.mean() / 1e3, "step_share": share, "mean_step_us": cells.mean_step()}
        | cells.evidence(),
        view=view,
        suggestion=suggestion,
        ms_per_step=cells.mean() / 1e3,
        step_share=share,
        stability=_stability(cells),
        instances=instances or [],
        steps=cells.steps(),
        ranks=sorted(per_rank),
    )


def _exposed(inputs: _Inputs, waits_known: set[str]) -> list[Finding]:
    """Exposed communication per scheme; `waits_known`: the schemes with an instance matched across ranks with
    arrivals; for the others how much of it is waiting for a late member is unknown (one rank's trace, or
    point-to-point calls only), not 0."""
    out = []
    for scheme, _ in inputs.of("exposed"):
        cells, wait = inputs.cells("exposed", scheme), inputs.cells("wait", scheme)
        if cells is None or wait is None:
            continue
        waiting = (wait.mean() / cells.mean() if cells.mean() else 0.0) if scheme in waits_known else None
        hint = ""
        if waiting is None:
            hint = (
                " How much of it is waiting for a late member is unknown: waits need the calls of the other "
                "members of its collectives matched call by call, and none of this scheme's was (one rank's "
                "trace, or point-to-point calls, which are not matched)."
            )
        elif waiting >= 0.5:
            hint = (
                f" Most of it ({pct(waiting)}) is waiting for a late member rather than transfer: the time page's "
                "arrivals and stragglers say who arrives last, and overlap will not remove that wait."
            )
        f = _timed(
            f"exposed-comm:{scheme}",
            f"{scheme}: {{ms}} of exposed communication per step ({{share}} of the step, no compute running)",
            cells,
            {
                "scheme": scheme,
                "wait_ms_per_step": wait.mean() / 1e3 if waits_known else None,
                "wait_share": waiting,
            },
            {"page": "time", "scheme": scheme},
            _SUGGEST_EXPOSED.get(scheme, "Overlap these collectives with independent compute.") + hint,
        )
        if f is not None:
            out.append(f)
    return out


def _memcpy(con: duckdb.DuckDBPyConnection, run_id: int, inputs: _Inputs) -> list[Finding]:
    cells = inputs.cells("memcpy", "")
    if cells is None:
        return []
    (htod, htod_busy, dtoh, dtoh_busy) = con.execute(
        "SELECT htod_bytes, htod_busy_us, dtoh_bytes, dtoh_busy_us FROM time_finding_runs WHERE run_id = ?", [run_id]
    ).fetchall()[0]
    moved = {"htod": (htod or 0, htod_busy or 0.0), "dtoh": (dtoh or 0, dtoh_busy or 0.0)}
    n = cells.count()
    evidence: dict[str, float | int | str | None] = {}
    for d in ("htod", "dtoh"):
        b, busy = moved[d]
        evidence[f"{d}_bytes_per_step"] = int(b / n)
        evidence[f"{d}_gbps"] = b / (busy * 1e3) if busy else None
    f = _timed(
        "memcpy-exposed",
        "{ms} per step of memory copies that no compute overlaps ({share} of the step)",
        cells,
        evidence,
        {"page": "time"},
        "Copy asynchronously from pinned memory (non_blocking=True on a side stream) and prefetch the next "
        "batch during compute; for host-offloaded optimizers overlap the parameter and gradient transfers with "
        "the backward, or keep states on the device when memory allows.",
    )
    return [] if f is None else [f]


def _stragglers(
    con: duckdb.DuckDBPyConnection, run_id: int, inputs: _Inputs, mean_step_us: float | None
) -> list[Finding]:
    rows = con.execute(
        """
        SELECT group_key, coalesce(scheme, 'unattributed'), rank, arrived_last_share, steps_mostly_last, steps,
               imposed_us_per_step, instances
        FROM time_stragglers WHERE run_id = ? AND straggler ORDER BY group_key
        """,
        [run_id],
    ).fetchall()
    out = []
    for group, scheme, rank, last_share, mostly, n_steps, imposed, n_inst in rows:
        waited = inputs.cells("straggler", group)
        if waited is None or _noise(waited) is not None:
            continue
        share = waited.mean() / mean_step_us if mean_step_us else 0.0
        ranks = sorted({*waited.ranks, rank})
        severity = _time_severity(share, waited.n_steps, len(ranks)) or "low"
        out.append(
            Finding(
                id=f"straggler:{group}",
                title=f"Rank {rank} is a persistent {scheme} straggler: its peers wait {dur(waited.mean())} per "
                f"step for it ({pct(share)} of the step)",
                severity=severity,
                impact=min(share, 1.0),
                evidence=waited.evidence()
                | {
                    "rank": rank,
                    "scheme": scheme,
                    "group": group,
                    "imposed_ms_per_step": imposed / 1e3,
                    "wait_ms_per_step": waited.mean() / 1e3,
                    "arrived_last_share": last_share,
                    "steps_mostly_last": mostly,
                    "steps": n_steps,
                    "instances": n_inst,
                },
                view={"page": "time", "scheme": scheme, "group": group, "rank": rank},
                suggestion=f"Rank {rank} reaches the {scheme} collectives last, by arrival, in most steps: look at "
                "what it does before them that its peers do not (data loading, a slower or throttled device, "
                "extra work on that rank such as logging or checkpointing, a noisy neighbour on its host).",
                ms_per_step=waited.mean() / 1e3,
                step_share=share,
                stability=f"caused most of the group's wait in {mostly} of {n_steps} steps; the others wait "
                + _stability(waited),
                instances=inputs.keys[("straggler", group, "")].top_instances,
                steps=waited.steps(),
                ranks=ranks,
            )
        )
    return out


def _wait_dominated(inputs: _Inputs) -> list[Finding]:
    """Collectives (per scheme and op) whose members spend most of their time in them waiting."""
    out = []
    for scheme, op in inputs.of("wait_dominated"):
        cells = inputs.cells("wait_dominated", scheme, op)
        dur = inputs.dur[("wait_dominated", scheme, op)]
        if cells is None or not dur:
            continue
        wait = fsum(x.value_us for x in cells.ranks.values())
        if wait / dur < WAIT_DOMINATES:
            continue
        key = inputs.keys[("wait_dominated", scheme, op)]
        f = _timed(
            f"wait-dominated:{scheme}:{op}",
            # the mean over every rank, the late one's none included (a straggler's title says its peers' wait)
            f"{scheme} {op}: {{ms}} per rank per step waiting inside the collective ({{share}} of the step), "
            f"{pct(wait / dur)} of its time",
            cells,
            {
                "scheme": scheme,
                "op": op,
                "wait_share_of_duration": wait / dur,
                "instances": key.instances,
                "wait_mostly_caused_by_rank": key.cause_rank,
                "caused_share": key.cause_wait_us / wait if key.cause_wait_us is not None and wait else None,
            },
            {"page": "time", "scheme": scheme, "op": op},
            "The collective itself is quick; its members wait for the last one to arrive. Find who arrives "
            "last (the straggler finding, the wait heatmap) and what delays it before this call; if no single "
            "rank does, the imbalance is in the work between calls (uneven shards, data loading, host syncs).",
            key.top_instances,
        )
        if f is not None:
            out.append(f)
    return out


def time_findings(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[list[Finding], bool]:
    """The timing findings and whether the run has the arrival analysis (a straggler verdict per group)."""
    by_arrival = bool(con.execute("SELECT count(*) FROM time_stragglers WHERE run_id = ?", [run_id]).fetchall()[0][0])
    inputs = _Inputs(con, run_id)
    whole = inputs.cells("memcpy", "")  # every (rank, step) with a step time
    mean_step = whole.mean_step() if whole is not None else None
    waits_known = {
        str(r[0])
        for r in con.execute(
            "SELECT DISTINCT coalesce(scheme, 'unattributed') FROM time_instances "
            "WHERE run_id = ? AND members > 1 AND last_rank IS NOT NULL",
            [run_id],
        ).fetchall()
    }
    found = _exposed(inputs, waits_known) + _memcpy(con, run_id, inputs)
    if by_arrival and mean_step:
        found += _stragglers(con, run_id, inputs, mean_step) + _wait_dominated(inputs)
    return found, by_arrival
