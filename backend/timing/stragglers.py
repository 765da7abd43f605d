"""Who everyone waits for: per rank, group and scheme, how often it arrived last and the wait it imposed.

A rank's imposed wait in an instance it arrived last in is the sum of the other members' waits. The
rule (StragglerRule, docs/time.md "straggler") weighs arrivals by the wait they cause, so that near-ties,
whose order is scheduling noise, count for nothing: in a step, a rank is "mostly last" in a group when
the instances it arrived last in carry >= `last_share` of the group's wait in that step. Its own-made
wait discounts what it inherited: a rank that arrives last because it waited for someone in another
group just before (the dp member of a tp pair whose peer is late) passes that wait on, it does not cause
it. A straggler is mostly last in >= `step_share` of >= `min_steps` steps over >= `min_instances`
instances; the wait it imposes net of what it suffered in the group, per step, is at least 1 / `max_spread`
times its standard deviation across steps and >= `min_imposed_share` of the mean step. Anything less
is "no straggler", with the reason.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import fmean, stdev

from .instances import InstanceStats
from .matching import Instances


@dataclass(frozen=True)
class StragglerRule:
    """Thresholds of the straggler rule; docs/time.md says why each has its value."""

    last_share: float = 0.75
    step_share: float = 0.75
    min_steps: int = 2
    min_instances: int = 6
    min_imposed_share: float = 0.05
    max_spread: float = 0.5
    # The smallest imposed wait per step that can name a straggler (µs). 0 for device-timed arrivals; host
    # clocks (gloo on CPU) get HOST_CLOCK_FLOOR_US: an oversubscribed host holds one rank back by the same
    # few ms every step, which no rule over arrivals can tell from a planted delay.
    min_imposed_us: float = 0.0


# Host-timed arrivals: two scheduler periods of Linux's CFS on a small host (sched_latency is 6 ms x
# (1 + log2(cpus)), 12 ms on 2 cores); the harness's delay tests plant 60 ms. Measured without any delay on a
# loaded 2-core host: one gloo rank 3.9 +- 1.5 ms and 8.8 +- 0.8 ms late every step (docs/time.md).
HOST_CLOCK_FLOOR_US = 24_000.0


DEFAULT_RULE = StragglerRule()


@dataclass
class RankArrivals:
    """One row per (group, rank): instances, how many it arrived last in, the wait it imposed and the
    wait it suffered (µs, summed), and in how many steps it was mostly last (module doc)."""

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
    """A group's candidate (named a straggler only when its verdict says so). `imposed_us_per_step` is
    its own-made imposed wait (inherited waits discounted) per step of the group; `net_us_per_step` and
    `spread_us` the mean and standard deviation across steps of that wait less the wait it suffered in
    the group."""

    group: str
    scheme: str
    rank: int
    arrived_last_share: float
    steps_mostly_last: int
    steps: int
    imposed_us_per_step: float
    instances: int
    net_us_per_step: float = 0.0
    spread_us: float = 0.0


@dataclass
class StragglerReport:
    ranks: RankArrivals
    stragglers: list[Straggler]
    verdicts: dict[str, str]  # group -> why it has, or has no, straggler


@dataclass
class _Acc:
    """One (group, rank) over the run, and per step: own-made imposed wait and suffered wait."""

    instances: int = 0
    last: int = 0
    imposed: float = 0.0
    waited: float = 0.0
    own_by_step: dict[int | None, float] = field(default_factory=lambda: defaultdict(float))
    waited_by_step: dict[int | None, float] = field(default_factory=lambda: defaultdict(float))


def _inherited(inst: Instances, stats: InstanceStats) -> dict[tuple[int, int], float]:
    """(instance, rank) -> the waits that rank suffered in other groups' instances of the same step
    since its previous arrival in this instance's group (or the step's start)."""
    events: dict[tuple[int, int | None], list[tuple[float, int, float]]] = defaultdict(list)
    for k in range(len(inst)):
        last = stats.last_arrival[k]
        if last is None:
            continue
        for r, w in zip(inst.member_rank[k], stats.member_wait_us[k], strict=True):
            events[(r, inst.step[k])].append((last - (w or 0.0), k, w or 0.0))
    out: dict[tuple[int, int], float] = {}
    for (r, _), evs in events.items():
        groups = {inst.group[k] for _, k, _ in evs}
        pending: dict[str, float] = defaultdict(float)
        for _, k, w in sorted(evs):
            g = inst.group[k]
            out[(k, r)] = pending.pop(g, 0.0)
            for other in groups - {g}:
                pending[other] += w
    return out


def find_stragglers(
    inst: Instances,
    stats: InstanceStats,
    mean_step_us: float | None,
    schemes: Mapping[str, str] | None = None,
    rule: StragglerRule = DEFAULT_RULE,
) -> StragglerReport:
    schemes = schemes or {}
    inherited = _inherited(inst, stats)
    acc: dict[tuple[str, int], _Acc] = defaultdict(_Acc)
    group_steps: dict[str, set[int | None]] = defaultdict(set)
    for k in range(len(inst)):
        g, last, waits = inst.group[k], stats.last_rank[k], stats.member_wait_us[k]
        if last is None:
            continue
        s = inst.step[k]
        group_steps[g].add(s)
        imposed = sum(x or 0.0 for x in waits)
        for r, w in zip(inst.member_rank[k], waits, strict=True):
            a = acc[(g, r)]
            a.instances += 1
            a.waited += w or 0.0
            a.waited_by_step[s] += w or 0.0
            if r == last:
                a.last += 1
                a.imposed += imposed
                a.own_by_step[s] += max(0.0, imposed - inherited.get((k, r), 0.0))
    out = StragglerReport(RankArrivals(), [], {})
    for g in sorted(group_steps):
        steps = sorted(group_steps[g], key=lambda s: (s is None, s or 0))
        members = sorted(r for gg, r in acc if gg == g)
        step_total = {s: sum(acc[(g, r)].own_by_step.get(s, 0.0) for r in members) for s in steps}
        best: Straggler | None = None
        for r in members:
            a = acc[(g, r)]
            mostly = sum(
                step_total[s] > 0 and a.own_by_step.get(s, 0.0) >= rule.last_share * step_total[s] for s in steps
            )
            row = out.ranks
            row.group.append(g)
            row.scheme.append(schemes.get(g, "unattributed"))
            row.rank.append(r)
            row.instances.append(a.instances)
            row.arrived_last.append(a.last)
            row.imposed_us.append(a.imposed)
            row.wait_us.append(a.waited)
            row.steps.append(len(steps))
            row.steps_mostly_last.append(mostly)
            net = [a.own_by_step.get(s, 0.0) - a.waited_by_step.get(s, 0.0) for s in steps]
            cand = Straggler(
                g,
                schemes.get(g, "unattributed"),
                r,
                a.last / a.instances if a.instances else 0.0,
                mostly,
                len(steps),
                sum(a.own_by_step.values()) / max(len(steps), 1),
                a.instances,
                fmean(net),
                stdev(net) if len(net) > 1 else 0.0,
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
            f"no straggler: the rank that caused most of the wait (rank {best.rank}) caused >= "
            f"{rule.last_share:.0%} of it in {best.steps_mostly_last} of {best.steps} steps"
        )
    if best.net_us_per_step <= 0 or best.spread_us > rule.max_spread * best.net_us_per_step:
        return (
            f"no straggler: rank {best.rank}'s wait imposed less suffered, {best.net_us_per_step / 1e3:.3g} ms "
            f"per step, varies by {best.spread_us / 1e3:.3g} ms across steps (noise: the effect must be at "
            f"least {1 / rule.max_spread:.3g}x its spread)"
        )
    if best.net_us_per_step < rule.min_imposed_us:
        return (
            f"no straggler: rank {best.rank} arrives last but imposes {best.net_us_per_step / 1e3:.3g} ms per step "
            f"(less what it waited), under the {rule.min_imposed_us / 1e3:.3g} ms that host clocks can resolve "
            "from the scheduler's own delays"
        )
    if mean_step_us is not None and best.net_us_per_step < rule.min_imposed_share * mean_step_us:
        return (
            f"no straggler: rank {best.rank} arrives last but imposes {best.net_us_per_step:.0f} µs per step "
            f"(less what it waited), under {rule.min_imposed_share:.0%} of the {mean_step_us:.0f} µs step"
        )
    return (
        f"straggler rank {best.rank}: caused >= {rule.last_share:.0%} of the group's wait in "
        f"{best.steps_mostly_last} of {best.steps} steps, imposing {best.imposed_us_per_step:.0f} µs per step "
        f"(± {best.spread_us:.0f} µs across steps)"
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
