"""One call for the whole time analysis of a job: match, align, per-instance numbers, breakdown,
stragglers and each step's critical path."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from commlens.contract.analysis import UNATTRIBUTED

from .breakdown import Breakdown, RankSpans, rank_spans, step_breakdown, wait_spans
from .clocks import ClockAlignment, align_clocks
from .critical_path import CriticalPath, critical_paths
from .instances import InstanceStats, instance_stats
from .matching import WORLD, MatchResult, match_table
from .model import CallTable, IntervalArrays, RankArrays, RankInput, StepArrays, call_table
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
) -> TimeAnalysis:
    """analyze over columns: every rank's timeline and the run's calls in one CallTable."""
    schemes = schemes or {}
    if ranks and not any(d.has_device for d in ranks.values()):
        rule = replace(rule, min_imposed_us=max(rule.min_imposed_us, HOST_CLOCK_FLOOR_US))
    match = match_table(calls, list(ranks), world_size or len(ranks))
    clocks = align_clocks(match.instances, sorted(ranks), hosts)
    stats = instance_stats(match.instances, clocks)
    spans = _spans(ranks, calls, wait_spans(match.instances, stats, clocks), schemes)
    bd = step_breakdown(ranks, spans)
    mean_step = sum(bd.step_us.tolist()) / len(bd.step_us) if len(bd.step_us) else None
    strag = find_stragglers(match.instances, stats, mean_step, schemes, rule)
    paths = critical_paths(ranks, spans, match.instances, stats, clocks)
    return TimeAnalysis(match, clocks, stats, bd, strag, paths)


def _spans(
    ranks: Mapping[int, RankArrays], calls: CallTable, waits: Mapping[int, np.ndarray], schemes: Mapping[str, str]
) -> dict[int, RankSpans]:
    """Each rank's spans; a call's scheme is its group's (WORLD for calls naming none), as a code into
    the sorted scheme names."""
    by_group = [schemes.get(g or WORLD, UNATTRIBUTED) for g in calls.groups] + [schemes.get(WORLD, UNATTRIBUTED)]
    names = sorted(set(by_group))
    code = np.asarray([names.index(s) for s in by_group], dtype=np.int64)[calls.group]  # -1: the last entry
    # calls by rank: the store's load sorts them so; else a stable sort (each rank's calls in their order)
    in_order = len(calls) < 2 or bool((calls.rank[1:] >= calls.rank[:-1]).all())
    order = None if in_order else np.argsort(calls.rank, kind="stable")
    sorted_ranks = calls.rank if order is None else calls.rank[order]
    out = {}
    for r, d in ranks.items():
        lo, hi = np.searchsorted(sorted_ranks, r, "left"), np.searchsorted(sorted_ranks, r, "right")
        rows = slice(int(lo), int(hi)) if order is None else order[lo:hi]
        out[r] = rank_spans(d, waits.get(r, np.zeros((0, 2))), calls, rows, code, names)
    return out
