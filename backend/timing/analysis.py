"""One call for the whole time analysis of a job: match, align, per-instance numbers, breakdown,
stragglers and each step's critical path."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from commlens.contract.analysis import UNATTRIBUTED

from .breakdown import Breakdown, joined_breakdown, rank_breakdown, rank_spans, wait_spans
from .clocks import ClockAlignment, align_clocks
from .critical_path import CriticalPath, PathWindows, walk_paths
from .instances import InstanceStats, instance_stats
from .matching import WORLD, MatchResult, match_table
from .model import MEMORY_KINDS, CallTable, IntervalArrays, Ints, RankArrays, RankInput, StepArrays, call_table
from .stragglers import DEFAULT_RULE, HOST_CLOCK_FLOOR_US, StragglerReport, StragglerRule, find_stragglers


@dataclass
class TimeAnalysis:
    match: MatchResult
    clocks: ClockAlignment
    stats: InstanceStats
    breakdown: Breakdown
    stragglers: StragglerReport
    paths: list[CriticalPath]


def analyze(
    ranks: Mapping[int, RankInput],
    world_size: int | None = None,
    hosts: Mapping[int, str] | None = None,
    schemes: Mapping[str, str] | None = None,
    rule: StragglerRule = DEFAULT_RULE,
) -> TimeAnalysis:
    """`schemes`: group key (matching.WORLD for unnamed groups) -> scheme; `hosts`: rank -> host. Arrivals
    timed by host clocks only (no rank has device activity) name stragglers above the host clock floor."""
    arrays = {
        r: RankArrays(r, d.has_device, IntervalArrays.of_columns(d.intervals), StepArrays.of_columns(d.steps))
        for r, d in ranks.items()
    }
    calls = call_table({r: d.calls for r, d in ranks.items()}, world_size or len(ranks))
    return analyze_columns(arrays, calls, world_size, hosts, schemes, rule)


def analyze_columns(
    ranks: Mapping[int, RankArrays],
    calls: CallTable,
    world_size: int | None = None,
    hosts: Mapping[int, str] | None = None,
    schemes: Mapping[str, str] | None = None,
    rule: StragglerRule = DEFAULT_RULE,
    intervals_of: Callable[[int], IntervalArrays] | None = None,
) -> TimeAnalysis:
    """analyze over columns: every rank's timeline and the run's calls in one CallTable. What needs a rank's
    intervals (its spans, breakdown, memcpy lane and its part of the critical paths) runs one rank at a
    time; `intervals_of(rank)` reads them at that rank's turn (the intervals in `ranks` are then not
    read), so one rank's timeline is held at a time, not the run's."""
    schemes = schemes or {}
    if ranks and not any(d.has_device for d in ranks.values()):
        rule = replace(rule, min_imposed_us=max(rule.min_imposed_us, HOST_CLOCK_FLOOR_US))
    match = match_table(calls, list(ranks), world_size or len(ranks))
    clocks = align_clocks(match.instances, sorted(ranks), hosts)
    stats = instance_stats(match.instances, clocks)
    waits = wait_spans(match.instances, stats, clocks)
    paths = walk_paths(ranks, match.instances, stats, clocks)
    windows = PathWindows(paths, ranks, clocks)
    code, names = _scheme_codes(calls, schemes)
    rows_of = _rank_rows(calls)
    parts, classes = [], {}
    for r in sorted(ranks):
        d = ranks[r] if intervals_of is None else replace(ranks[r], intervals=intervals_of(r))
        spans = rank_spans(d, waits.pop(r, np.zeros((0, 2))), calls, rows_of(r), code, names)
        # past the spans, the breakdown's copied bytes and the memcpy lane read only the memory intervals
        d = replace(d, intervals=d.intervals.subset(d.intervals.of(MEMORY_KINDS)))
        parts.append(rank_breakdown(r, d, spans))
        if r in windows.ranks:
            classes[r] = windows.classify(r, spans)
        del d, spans
    bd = joined_breakdown(parts)
    windows.classify_into(paths, classes)
    mean_step = sum(bd.step_us.tolist()) / len(bd.step_us) if len(bd.step_us) else None
    strag = find_stragglers(match.instances, stats, mean_step, schemes, rule)
    return TimeAnalysis(match, clocks, stats, bd, strag, paths)


def _scheme_codes(calls: CallTable, schemes: Mapping[str, str]) -> tuple[Ints, list[str]]:
    """Each call's scheme (its group's; WORLD's for calls naming none) as a code into the sorted names."""
    by_group = [schemes.get(g or WORLD, UNATTRIBUTED) for g in calls.groups] + [schemes.get(WORLD, UNATTRIBUTED)]
    names = sorted(set(by_group))
    code = np.asarray([names.index(s) for s in by_group], dtype=np.int64)[calls.group]  # -1: the last entry
    return code, names


def _rank_rows(calls: CallTable) -> Callable[[int], Ints | slice]:
    """A rank's rows of the CallTable: a slice where calls are by rank (the store's load sorts them so),
    else their positions in a stable sort (each rank's calls in their order)."""
    in_order = len(calls) < 2 or bool((calls.rank[1:] >= calls.rank[:-1]).all())
    order = None if in_order else np.argsort(calls.rank, kind="stable")
    sorted_ranks = calls.rank if order is None else calls.rank[order]

    def rows(r: int) -> Ints | slice:
        lo, hi = np.searchsorted(sorted_ranks, r, "left"), np.searchsorted(sorted_ranks, r, "right")
        return slice(int(lo), int(hi)) if order is None else order[lo:hi]

    return rows
