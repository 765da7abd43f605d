"""Per instance: arrival skew, each member's wait, the last arrival and the collective's real time.

arrival = the member's call start (device kernel start where the trace has one, else the CPU op), on
the reference clock. skew = last arrival - first arrival; wait(member) = last arrival - its arrival.
real_us = end - arrival on the member that arrived last: the time the collective took once everybody
was there (that member never waited). algbw = S / real_us and busbw = algbw x the nccl-tests factor,
both on real_us, in GB/s (1e9 bytes). None (NaN in the columns; last_rank -1) where a time is missing
or clocks cannot be trusted. Every quantity is a column operation over the instances' member arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from commlens.vocab import busbw_factor

from .clocks import ClockAlignment
from .matching import Instances
from .model import F64, Ints


def _nones(x: F64) -> list[float | None]:
    return [None if v != v else v for v in x.tolist()]


@dataclass
class InstanceStats:
    skew: F64
    last_rank_code: Ints  # -1: none
    last: F64  # reference clock
    real: F64
    algbw: F64
    busbw: F64
    m_wait: F64  # per member (Instances' flat order)
    m_arrival_ref: F64
    notes: list[str] = field(default_factory=list)
    _inst: Instances | None = field(default=None, repr=False)
    # per member: the part of its wait its rank was not already waiting through in an earlier-arriving instance
    # (calls in flight together, DDP's buckets: a rank waiting for two of them at once waits once), so the sum
    # over a rank's members is the time it spent waiting; None: the same as m_wait (no overlap computed)
    m_wait_excl: F64 | None = None

    @property
    def exclusive_wait(self) -> F64:
        return self.m_wait if self.m_wait_excl is None else self.m_wait_excl

    @property
    def skew_us(self) -> list[float | None]:
        return _nones(self.skew)

    @property
    def last_rank(self) -> list[int | None]:
        return [None if r < 0 else r for r in self.last_rank_code.tolist()]

    @property
    def last_arrival(self) -> list[float | None]:
        return _nones(self.last)

    @property
    def real_us(self) -> list[float | None]:
        return _nones(self.real)

    @property
    def algbw_gbps(self) -> list[float | None]:
        return _nones(self.algbw)

    @property
    def busbw_gbps(self) -> list[float | None]:
        return _nones(self.busbw)

    @property
    def member_wait_us(self) -> list[tuple[float | None, ...]]:
        assert self._inst is not None
        return [tuple(None if x != x else x for x in t) for t in self._inst.per_member(self.m_wait)]


def instance_stats(inst: Instances, clocks: ClockAlignment) -> InstanceStats:
    n = len(inst)
    nan = np.full(n, np.nan)
    notes: list[str] = []
    if not clocks.trusted:
        notes.append(f"skew and waits not computed: {clocks.reason}")
    off = clocks.offset_of(inst.m_rank)
    arr = inst.m_arrival + off
    untimed = bool(n) and clocks.trusted and _no_start_times(arr)
    if untimed:
        notes.append(_missing_note(n))
    if not n or not clocks.trusted or untimed:
        empty = np.full(len(arr), np.nan)
        return InstanceStats(nan, np.full(n, -1), nan, nan, nan.copy(), nan.copy(), empty, arr, notes, inst)
    starts = inst.offsets[:-1]
    known = ~np.add.reduceat(np.isnan(arr), starts).astype(bool)
    missing = int((~known).sum())
    filled = np.where(np.isnan(arr), -np.inf, arr)
    hi = np.maximum.reduceat(filled, starts)
    lo = np.minimum.reduceat(np.where(np.isnan(arr), np.inf, arr), starts)
    # The last arrival: the latest start, the highest rank among equal ones (members are in rank order).
    pos = np.arange(len(arr), dtype=np.int64)
    last_pos = np.maximum.reduceat(np.where(filled == hi[inst.m_inst], pos, -1), starts)
    last = np.where(known, hi, np.nan)
    skew = last - lo
    last_rank = np.where(known, inst.m_rank[last_pos], -1)
    m_known = known[inst.m_inst]
    wait = np.where(m_known, last[inst.m_inst] - arr, np.nan)
    real = np.where(known, (inst.m_end[last_pos] + off[last_pos]) - last, np.nan)
    factor = np.ones(n)
    members = inst.members
    width = int(members.max()) + 1
    for pair in np.unique(inst.op_code * width + members).tolist():  # the few distinct (op, members) pairs
        op, size = divmod(pair, width)
        factor[(inst.op_code == op) & (members == size)] = busbw_factor(inst.ops[op], size)
    ok = known & (real > 0) & inst.has_size
    with np.errstate(invalid="ignore", divide="ignore"):
        alg = np.where(ok, inst.size / (real * 1e3), np.nan)
    bus = np.where(ok, alg * factor, np.nan)
    if missing:
        notes.append(_missing_note(missing))
    excl = exclusive_waits(inst.m_rank, arr, wait)
    return InstanceStats(skew, last_rank, last, real, alg, bus, wait, arr, notes, inst, excl)


def exclusive_waits(rank: Ints, arrival: F64, wait: F64) -> F64:
    """Per member, the part of [arrival, arrival + wait] that no earlier-arriving member of the same rank
    covers: summed over a rank, the length of the union of its wait intervals. NaN where the wait is."""
    out = np.full(len(wait), np.nan)
    timed = np.flatnonzero(~np.isnan(wait))
    if not len(timed):
        return out
    o = timed[np.lexsort((arrival[timed], rank[timed]))]
    r, start = rank[o], arrival[o]
    end = start + wait[o]
    cuts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    excl = np.empty(len(o))
    for a, b in zip(cuts.tolist(), [*cuts[1:].tolist(), len(o)], strict=True):
        reached = np.maximum.accumulate(end[a:b])  # the latest end of the rank's waits so far
        before = np.r_[-np.inf, reached[:-1]]
        excl[a:b] = np.maximum(0.0, end[a:b] - np.maximum(start[a:b], before))
    out[o] = excl
    return out


def _no_start_times(arrivals: F64) -> bool:
    """No member has a start time (NCCL logs): every number instance_stats computes would be None, so it
    returns them at once (the same values and note as the computation; tests compare the two)."""
    return bool(np.isnan(arrivals).all())


def _missing_note(instances: int) -> str:
    return f"{instances} instances have a member without a start time: no skew or wait for them"
