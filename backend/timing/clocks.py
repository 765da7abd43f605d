"""Clock offsets between hosts, estimated from the instances themselves.

All members of a blocking symmetric collective (SYMMETRIC_OPS) leave it together, so their end times differ only by the hosts'
clock offset plus a little noise. Per clock domain (a host; a rank on its own when hosts are unknown)
the offset against the reference domain (the lowest rank's) is the median of the end differences over
the instances both take part in. The data must support it: at least `min_instances` common instances,
and a spread (median absolute deviation) within `tolerance_us`; otherwise nothing is aligned and the
reason says why. Ranks of one host share a clock. When hosts are unknown, offsets within the noise
(|offset| <= max(tolerance, 3 x spread)) mean one shared clock, and none is applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .matching import Instances
from .model import F64, Bools, Ints

MIN_INSTANCES = 5
# Ops whose members all leave together; rooted ops (broadcast, reduce, gather, scatter) let the root or
# the leaves go early, so their end times say nothing about clocks.
SYMMETRIC_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"})
TOLERANCE_US = 50.0


@dataclass
class DomainEstimate:
    domain: str
    ranks: list[int]
    instances: int
    offset_us: float | None  # added to the domain's times to put them on the reference clock
    spread_us: float | None


@dataclass
class ClockAlignment:
    offsets: dict[int, float]  # per rank; 0.0 where nothing is applied
    applied: bool
    trusted: bool  # cross-rank differences (skew, wait) are meaningful
    reason: str
    domains: list[DomainEstimate] = field(default_factory=list)

    def to_reference(self, rank: int, t: float) -> float:
        return t + self.offsets.get(rank, 0.0)

    def offset_of(self, ranks: Ints) -> F64:
        """Each given rank's offset (0.0 where none is applied), as an array."""
        table = np.zeros(int(ranks.max()) + 1 if len(ranks) else 0, dtype=np.float64)
        for r, off in self.offsets.items():
            if r < len(table):
                table[r] = off
        return table[ranks]


def align_clocks(
    inst: Instances,
    ranks: list[int],
    hosts: Mapping[int, str] | None = None,
    min_instances: int = MIN_INSTANCES,
    tolerance_us: float = TOLERANCE_US,
) -> ClockAlignment:
    """Estimate per-domain offsets from instance end times; see the module docstring for the rule."""
    zero = dict.fromkeys(ranks, 0.0)
    dom = {r: (hosts[r] if hosts and r in hosts else f"rank{r}") for r in ranks}
    domains = sorted(set(dom.values()), key=lambda d: min(r for r in ranks if dom[r] == d))
    if len(domains) <= 1:
        return ClockAlignment(zero, False, True, "one clock domain: no offset needed")
    if not np.isfinite(inst.m_end).any():  # each domain has its ranks and no timed instance
        untimed = [DomainEstimate(d, [r for r in ranks if dom[r] == d], 0, None, None) for d in domains]
        why = (
            "no collective matched across ranks (point-to-point calls are not matched): no instance to align clocks by"
            if not len(inst)
            else "the calls carry no times (NCCL logs): no clocks to align"
        )
        return ClockAlignment(zero, False, False, why, untimed)
    ref = dom[min(ranks)]
    diffs = _end_differences(inst, ranks, dom, domains, ref)
    estimates = [DomainEstimate(ref, [r for r in ranks if dom[r] == ref], int(_symmetric(inst).sum()), 0.0, 0.0)]
    problems: list[str] = []
    for d in domains[1:]:
        members = [r for r in ranks if dom[r] == d]
        xs = diffs.get(d, np.zeros(0))
        if len(xs) < min_instances:
            estimates.append(DomainEstimate(d, members, len(xs), None, None))
            problems.append(f"{d}: {len(xs)} instances shared with {ref} (need {min_instances})")
            continue
        med = float(np.median(xs))
        spread = float(np.median(np.abs(xs - med)))
        estimates.append(DomainEstimate(d, members, len(xs), -med, spread))
        if spread > tolerance_us:
            problems.append(f"{d}: end differences spread {spread:.1f} µs (> {tolerance_us:.0f} µs): inconsistent")
    if problems:
        why = "clocks not aligned: " + "; ".join(problems)
        if hosts is None:
            why += " (hosts unknown: each rank's own clock is used as is)"
        return ClockAlignment(zero, False, hosts is None, why, estimates)
    if hosts is None and all(
        e.offset_us is not None and e.spread_us is not None and abs(e.offset_us) <= max(tolerance_us, 3 * e.spread_us)
        for e in estimates
    ):
        return ClockAlignment(zero, False, True, "offsets within the noise: one shared clock, none applied", estimates)
    offsets = {r: next(e.offset_us or 0.0 for e in estimates if r in e.ranks) for r in ranks}
    return ClockAlignment(offsets, True, True, "aligned on instance end times", estimates)


def _symmetric(inst: Instances) -> Bools:
    return np.isin(inst.op_code, [i for i, o in enumerate(inst.ops) if o in SYMMETRIC_OPS])


def _end_differences(
    inst: Instances, ranks: list[int], dom: Mapping[int, str], domains: list[str], ref: str
) -> dict[str, F64]:
    """Per domain other than `ref`, over the symmetric instances both take part in (instance order), the
    median of the domain's member end times less that of the reference domain's (statistics.median's
    rule: the middle value, or the mean of the two middle ones)."""
    code = {d: i for i, d in enumerate(domains)}
    dom_of = np.full(max(ranks) + 1, -1, dtype=np.int64)
    for r in ranks:
        dom_of[r] = code[dom[r]]
    keep = _symmetric(inst)[inst.m_inst] & ~np.isnan(inst.m_end)
    k, d, e = inst.m_inst[keep], dom_of[inst.m_rank[keep]], inst.m_end[keep]
    order = np.lexsort((e, d, k))
    k, d, e = k[order], d[order], e[order]
    if not len(k):
        return {}
    new = np.r_[True, (k[1:] != k[:-1]) | (d[1:] != d[:-1])]
    first = np.flatnonzero(new)
    n = np.diff(np.r_[first, len(k)])
    mid = first + n // 2
    med = np.where(n % 2 == 1, e[mid], (e[mid - 1] + e[mid]) / 2)
    gk, gd = k[first], d[first]
    ref_code = code[ref]
    base = np.full(len(inst), np.nan)
    is_ref = gd == ref_code
    base[gk[is_ref]] = med[is_ref]
    use = ~is_ref & ~np.isnan(base[gk])
    out: dict[str, F64] = {}
    for c in np.unique(gd[use]).tolist():
        sel = use & (gd == c)
        out[domains[c]] = med[sel] - base[gk[sel]]
    return out
