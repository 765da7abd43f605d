"""Who everyone waits for: per rank, group and scheme, how often it arrived last and the wait it imposed.

A rank's imposed wait in an instance it arrived last in is the sum of the other members' waits, each counted
once where calls in flight together overlap (InstanceStats.exclusive_wait: a rank waiting for two of DDP's
buckets at once waits once, for the first to arrive). The
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

from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import fmean, stdev

import numpy as np

from .instances import InstanceStats
from .matching import Instances
from .model import F64, Ints
from .segments import sequential_sums


@dataclass(frozen=True)
class StragglerRule:
    """Thresholds of the straggler rule; docs/time.md says why each has its value."""

    last_share: float = 0.75
    step_share: float = 0.75
    min_steps: int = 4  # a spread across steps needs 4 (two runs of 2 steps named different stragglers)
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
    # per instance: the wait its last arrival imposed on the others less what that rank inherited (NaN
    # without a last arrival); the wait-dominated finding names the rank that caused most of it
    last_own_us: F64 = field(default_factory=lambda: np.zeros(0, dtype=np.float64))


def _step_codes(inst: Instances, ks: Ints) -> tuple[Ints, list[int | None]]:
    """Each instance's step as a code into the sorted steps (None last)."""
    has, step = inst.has_step[ks], np.where(inst.has_step[ks], inst.steps[ks], 0)
    pairs = np.stack([~has, step], axis=1)
    uniq, code = np.unique(pairs, axis=0, return_inverse=True)
    return code.reshape(-1).astype(np.int64), [None if n else int(s) for n, s in uniq.tolist()]


def _inherited(inst: Instances, stats: InstanceStats) -> F64:
    """Per member (Instances' flat order): the waits its rank suffered in other groups' instances of the
    same step since its previous arrival in this instance's group (or the step's start)."""
    out = np.zeros(len(inst.m_rank), dtype=np.float64)
    has_last = stats.last_rank_code >= 0
    groups = np.unique(inst.group_code[has_last])
    if len(groups) < 2:
        return out
    p = np.flatnonzero(has_last[inst.m_inst])
    k = inst.m_inst[p]
    w = np.nan_to_num(stats.exclusive_wait[p])
    t = stats.last[k] - w
    g, r = inst.group_code[k], inst.m_rank[p]
    has, step = inst.has_step[k], np.where(inst.has_step[k], inst.steps[k], 0)
    o = np.lexsort((w, k, t, step, has, r))
    p, w, g, r, has, step = p[o], w[o], g[o], r[o], has[o], step[o]
    new_rs = np.r_[True, (r[1:] != r[:-1]) | (has[1:] != has[:-1]) | (step[1:] != step[:-1])]
    for c in groups.tolist():
        is_c = g == c
        begin = new_rs | np.r_[False, is_c[:-1]]
        seg = np.cumsum(begin) - 1
        sums = sequential_sums(np.where(is_c, 0.0, w), np.bincount(seg))
        out[p[is_c]] = sums[seg[is_c]]
    return out


def _last_own(inst: Instances, stats: InstanceStats, inherited: F64) -> F64:
    """Per instance: the members' waits summed, less what its last arrival inherited (module doc)."""
    imposed = sequential_sums(np.nan_to_num(stats.exclusive_wait), inst.members)
    has_last = stats.last_rank_code >= 0
    inherited_last = np.zeros(len(imposed), dtype=np.float64)
    is_last = inst.m_rank == stats.last_rank_code[inst.m_inst]
    inherited_last[inst.m_inst[is_last]] = inherited[is_last]
    return np.where(has_last, np.maximum(0.0, imposed - inherited_last), np.nan)


def find_stragglers(
    inst: Instances,
    stats: InstanceStats,
    mean_step_us: float | None,
    schemes: Mapping[str, str] | None = None,
    rule: StragglerRule = DEFAULT_RULE,
) -> StragglerReport:
    schemes = schemes or {}
    last_own = _last_own(inst, stats, _inherited(inst, stats))
    out = StragglerReport(RankArrivals(), [], {}, last_own)
    with_last = np.flatnonzero(stats.last_rank_code >= 0)
    codes = np.unique(inst.group_code[with_last]).tolist()
    for gc in sorted(codes, key=lambda c: inst.groups[c]):
        g = inst.groups[gc]
        ks = with_last[inst.group_code[with_last] == gc]
        nm = int(inst.offsets[ks[0] + 1] - inst.offsets[ks[0]])
        idx = inst.offsets[ks][:, None] + np.arange(nm)
        members = inst.m_rank[idx[0]].tolist()
        waits = np.nan_to_num(stats.exclusive_wait[idx])
        is_last = inst.m_rank[idx] == stats.last_rank_code[ks][:, None]
        imposed = np.cumsum(waits, axis=1)[:, -1]
        own = np.where(is_last, last_own[ks][:, None], 0.0)
        sc, steps = _step_codes(inst, ks)
        o = np.argsort(sc, kind="stable")
        counts = np.bincount(sc, minlength=len(steps))
        waited_step = sequential_sums(waits[o], counts)
        own_step = sequential_sums(own[o], counts)
        step_total = np.cumsum(own_step, axis=1)[:, -1]
        waited_all = np.cumsum(waits, axis=0)[-1]
        best: Straggler | None = None
        for j, r in enumerate(members):
            lastj = is_last[:, j]
            n_last = int(lastj.sum())
            imposed_r = float(np.cumsum(imposed[lastj])[-1]) if n_last else 0.0
            # own wait per step, summed in the order its steps first saw it arrive last
            seen, first = np.unique(sc[lastj], return_index=True)
            own_sum = float(np.cumsum(own_step[seen[np.argsort(first)], j])[-1]) if len(seen) else 0.0
            col = own_step[:, j]
            mostly = int(((step_total > 0) & (col >= rule.last_share * step_total)).sum())
            row = out.ranks
            row.group.append(g)
            row.scheme.append(schemes.get(g, "unattributed"))
            row.rank.append(r)
            row.instances.append(len(ks))
            row.arrived_last.append(n_last)
            row.imposed_us.append(imposed_r)
            row.wait_us.append(float(waited_all[j]))
            row.steps.append(len(steps))
            row.steps_mostly_last.append(mostly)
            net = (col - waited_step[:, j]).tolist()
            cand = Straggler(
                g,
                schemes.get(g, "unattributed"),
                r,
                n_last / len(ks),
                mostly,
                len(steps),
                own_sum / max(len(steps), 1),
                len(ks),
                fmean(net),
                stdev(net) if len(net) > 1 else 0.0,
            )
            if best is None or (cand.steps_mostly_last, cand.imposed_us_per_step) > (
                best.steps_mostly_last,
                best.imposed_us_per_step,
            ):
                best = cand
        out.verdicts[g] = (
            "no straggler: a one-member group: nothing waits for anything"
            if nm < 2
            else _verdict(best, mean_step_us, rule)
        )
        if best is not None and out.verdicts[g].startswith("straggler"):
            out.stragglers.append(best)
    return out


def _verdict(best: Straggler | None, mean_step_us: float | None, rule: StragglerRule) -> str:
    if best is None:
        return "no straggler: no instance with arrival times"
    if best.instances < rule.min_instances:
        return f"no straggler: {best.instances} instances in the group, consistency needs {rule.min_instances}"
    if best.steps < rule.min_steps:
        return (
            f"no straggler: too few profiled steps to tell: {best.steps} step(s) with instances, consistency "
            f"needs {rule.min_steps}"
        )
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
    arrived last in, and its total wait (the last member's arrival minus its own, summed where the waits do not
    overlap: the time it spent waiting)."""

    rank: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    arrived_last: list[int] = field(default_factory=list)
    wait_us: list[float] = field(default_factory=list)


def rank_totals(inst: Instances, stats: InstanceStats) -> RankTotals:
    has = np.flatnonzero(stats.last_rank_code[inst.m_inst] >= 0)
    k = inst.m_inst[has]
    r = inst.m_rank[has]
    o = np.argsort(r, kind="stable")
    r, k = r[o], k[o]
    waits = np.nan_to_num(stats.exclusive_wait[has][o])
    ranks, counts = np.unique(r, return_counts=True)
    last = np.bincount(np.searchsorted(ranks, r), weights=r == stats.last_rank_code[k], minlength=len(ranks))
    wait = sequential_sums(waits, counts)
    steps = np.unique(np.stack([r, inst.has_step[k], np.where(inst.has_step[k], inst.steps[k], 0)], axis=1), axis=0)
    n_steps = np.bincount(np.searchsorted(ranks, steps[:, 0]), minlength=len(ranks)) if len(steps) else counts * 0
    return RankTotals(ranks.tolist(), n_steps.tolist(), counts.tolist(), [int(x) for x in last.tolist()], wait.tolist())
