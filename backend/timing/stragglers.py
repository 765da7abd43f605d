"""Who everyone waits for: per rank, group and scheme, how often it arrived last and the wait it imposed.

A rank's imposed wait in an instance it arrived last in is the sum of the other members' waits. The
rule that names a straggler (StragglerRule): in a group with at least `min_steps` profiled steps that
have instances, the rank arrived last in >= `last_share` of the group's instances in >= `step_share`
of those steps, and the wait it imposed averages >= `min_imposed_share` of the mean step time per
step, over at least `min_instances` instances of the group. Anything less is "no straggler", with the
reason.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from .instances import InstanceStats
from .matching import Instances


@dataclass(frozen=True)
class StragglerRule:
    last_share: float = 0.75
    step_share: float = 0.75
    min_steps: int = 2
    min_instances: int = 6
    min_imposed_share: float = 0.01


DEFAULT_RULE = StragglerRule()


@dataclass
class RankArrivals:
    """One row per (group, rank): instances, how many it arrived last in, the wait it imposed and the
    wait it suffered (µs, summed), and in how many steps it was last in >= rule.last_share of them."""

    group: list[str] = field(default_factory=list)
    scheme: list[str] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    arrived_last: list[int] = field(default_factory=list)
    imposed_us: list[float] = field(default_factory=list)
    wait_us: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    steps_mostly_last: list[int] = field(default_factory=list)


@dataclass
class Straggler:
    group: str
    scheme: str
    rank: int
    arrived_last_share: float
    steps_mostly_last: int
    steps: int
    imposed_us_per_step: float
    instances: int


@dataclass
class StragglerReport:
    ranks: RankArrivals
    stragglers: list[Straggler]
    verdicts: dict[str, str]  # group -> why it has, or has no, straggler


def find_stragglers(
    inst: Instances,
    stats: InstanceStats,
    mean_step_us: float | None,
    schemes: Mapping[str, str] | None = None,
    rule: StragglerRule = DEFAULT_RULE,
) -> StragglerReport:
    schemes = schemes or {}
    counts: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
    per_step: dict[tuple[str, int | None], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    step_n: dict[tuple[str, int | None], int] = defaultdict(int)
    for k in range(len(inst)):
        g, last, waits = inst.group[k], stats.last_rank[k], stats.member_wait_us[k]
        if last is None:
            continue
        step_n[(g, inst.step[k])] += 1
        per_step[(g, inst.step[k])][last] += 1
        for r, w in zip(inst.member_rank[k], waits, strict=True):
            c = counts[(g, r)]
            c[0] += 1
            c[3] += w or 0.0
            if r == last:
                c[1] += 1
                c[2] += sum(x or 0.0 for x in waits)
    out = StragglerReport(RankArrivals(), [], {})
    for g in sorted({g for g, _ in counts}):
        steps = sorted((s for gg, s in step_n if gg == g), key=lambda s: (s is None, s or 0))
        best: Straggler | None = None
        for (gg, r), (n, last_n, imposed, waited) in sorted(counts.items()):
            if gg != g:
                continue
            mostly = sum(per_step[(g, s)].get(r, 0) >= rule.last_share * step_n[(g, s)] for s in steps)
            a = out.ranks
            a.group.append(g)
            a.scheme.append(schemes.get(g, "unattributed"))
            a.rank.append(r)
            a.instances.append(int(n))
            a.arrived_last.append(int(last_n))
            a.imposed_us.append(imposed)
            a.wait_us.append(waited)
            a.steps.append(len(steps))
            a.steps_mostly_last.append(mostly)
            cand = Straggler(
                g,
                schemes.get(g, "unattributed"),
                r,
                last_n / n if n else 0.0,
                mostly,
                len(steps),
                imposed / max(len(steps), 1),
                int(n),
            )
            if best is None or (cand.steps_mostly_last, cand.imposed_us_per_step) > (
                best.steps_mostly_last,
                best.imposed_us_per_step,
            ):
                best = cand
        out.verdicts[g] = _verdict(best, mean_step_us, rule)
        if best is not None and out.verdicts[g].startswith("straggler"):
            out.stragglers.append(best)
    return out


def _verdict(best: Straggler | None, mean_step_us: float | None, rule: StragglerRule) -> str:
    if best is None:
        return "no straggler: no instance with arrival times"
    if best.instances < rule.min_instances:
        return f"no straggler: {best.instances} instances in the group, consistency needs {rule.min_instances}"
    if best.steps < rule.min_steps:
        return f"no straggler: {best.steps} step(s) with instances, consistency needs {rule.min_steps}"
    if best.steps_mostly_last < rule.step_share * best.steps:
        return (
            f"no straggler: the most frequent last arrival (rank {best.rank}) was last in >= "
            f"{rule.last_share:.0%} of instances in {best.steps_mostly_last} of {best.steps} steps"
        )
    if mean_step_us is not None and best.imposed_us_per_step < rule.min_imposed_share * mean_step_us:
        return (
            f"no straggler: rank {best.rank} arrives last but imposes {best.imposed_us_per_step:.0f} µs per step, "
            f"under {rule.min_imposed_share:.0%} of the {mean_step_us:.0f} µs step"
        )
    return (
        f"straggler rank {best.rank}: last in >= {rule.last_share:.0%} of instances in {best.steps_mostly_last} "
        f"of {best.steps} steps, imposing {best.imposed_us_per_step:.0f} µs per step"
    )


@dataclass
class RankTotals:
    """Per rank over all its matched instances (the report's `time.ranks`): instances, how many it
    arrived last in, and its total wait (the last member's arrival minus its own, summed)."""

    rank: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    arrived_last: list[int] = field(default_factory=list)
    wait_us: list[float] = field(default_factory=list)


def rank_totals(inst: Instances, stats: InstanceStats) -> RankTotals:
    acc: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    steps: dict[int, set[int | None]] = defaultdict(set)
    for k in range(len(inst)):
        last = stats.last_rank[k]
        if last is None:
            continue
        for r, w in zip(inst.member_rank[k], stats.member_wait_us[k], strict=True):
            a = acc[r]
            a[0] += 1
            a[1] += r == last
            a[2] += w or 0.0
            steps[r].add(inst.step[k])
    out = RankTotals()
    for r in sorted(acc):
        n, last_n, wait = acc[r]
        out.rank.append(r)
        out.steps.append(len(steps[r]))
        out.instances.append(int(n))
        out.arrived_last.append(int(last_n))
        out.wait_us.append(wait)
    return out
