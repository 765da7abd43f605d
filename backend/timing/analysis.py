"""One call for the whole time analysis of a job: match, align, per-instance numbers, breakdown,
stragglers and each step's critical path."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from .breakdown import Breakdown, rank_spans, step_breakdown, wait_spans
from .clocks import ClockAlignment, align_clocks
from .critical_path import CriticalPath, critical_paths
from .instances import InstanceStats, instance_stats
from .matching import MatchResult, match_instances
from .model import RankInput
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
    schemes = schemes or {}
    if ranks and not any(d.has_device for d in ranks.values()):
        rule = replace(rule, min_imposed_us=max(rule.min_imposed_us, HOST_CLOCK_FLOOR_US))
    match = match_instances({r: d.calls for r, d in ranks.items()}, world_size)
    clocks = align_clocks(match.instances, sorted(ranks), hosts)
    stats = instance_stats(match.instances, clocks)
    waits = wait_spans(match.instances, stats, clocks)
    spans = {r: rank_spans(d, waits.get(r, []), schemes) for r, d in ranks.items()}
    bd = step_breakdown(ranks, spans)
    mean_step = sum(bd.step_us) / len(bd.step_us) if bd.step_us else None
    strag = find_stragglers(match.instances, stats, mean_step, schemes, rule)
    paths = critical_paths(ranks, spans, match.instances, stats, clocks)
    return TimeAnalysis(match, clocks, stats, bd, strag, paths)
