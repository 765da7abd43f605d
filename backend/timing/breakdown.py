"""Per rank and step: where each microsecond of the step went, counted once.

The step window is cut into elementary segments at every interval boundary; each segment takes the
first category that applies, in this precedence:
  compute     a compute kernel runs (CPU-only traces: a non-communication CPU op), no communication
  overlapped  compute and communication both run (communication hidden by compute)
  wait        communication runs, no compute, and the rank is inside a collective before its last
              member arrived (a part of exposed communication, reported apart)
  exposed     communication runs, no compute, everybody has arrived (the transfer itself)
  memcpy      no compute or communication; a memcpy or memset runs
  idle        nothing runs on the device
So compute > communication (wait before transfer) > memcpy > idle, as in DESIGN's rule; the six
categories sum to the step's duration. Communication time is split per scheme by the call covering it
(the earliest-started call when several do; "unattributed" when no call does, e.g. a kernel the ingest
skipped, or the group has no scheme).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .clocks import ClockAlignment
from .instances import InstanceStats
from .matching import WORLD, Instances
from .model import COMM, COMPUTE, EPS, MEMORY_KINDS, Calls, Intervals, RankInput

CATEGORIES = ("compute", "overlapped", "wait", "exposed", "memcpy", "idle")
UNATTRIBUTED = "unattributed"
Spans = list[tuple[float, float]]


@dataclass
class RankSpans:
    """One rank's activity in its own clock, ready to classify any window."""

    compute: Spans
    comm: Spans
    memory: Spans
    wait: Spans
    calls: list[tuple[float, float, str]]  # (start, end, scheme)


@dataclass
class Breakdown:
    """One row per (rank, step); `by_scheme` rows: (rank, step, scheme, overlapped, wait, exposed)."""

    rank: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    step_us: list[float] = field(default_factory=list)
    compute_us: list[float] = field(default_factory=list)
    overlapped_us: list[float] = field(default_factory=list)
    wait_us: list[float] = field(default_factory=list)
    exposed_us: list[float] = field(default_factory=list)
    memcpy_us: list[float] = field(default_factory=list)
    idle_us: list[float] = field(default_factory=list)
    htod_bytes: list[int] = field(default_factory=list)  # memcpy lane: copies starting in the step
    dtoh_bytes: list[int] = field(default_factory=list)
    memcpy_busy_us: list[float] = field(default_factory=list)  # time any memcpy/memset runs (overlaps included)
    by_scheme: list[tuple[int, int, str, float, float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def scheme_of_call(calls: Calls, i: int, schemes: Mapping[str, str]) -> str:
    return schemes.get(calls.group_key[i] or WORLD, UNATTRIBUTED)


def rank_spans(
    rank: int,
    data: RankInput,
    inst: Instances,
    stats: InstanceStats,
    clocks: ClockAlignment,
    schemes: Mapping[str, str],
) -> RankSpans:
    iv = data.intervals
    calls = data.calls
    spans = RankSpans(_kind(iv, {COMPUTE}), _kind(iv, {COMM}), _kind(iv, MEMORY_KINDS), [], [])
    for i in range(len(calls.seq)):
        a, e = calls.arrival[i], calls.end[i]
        if a is not None and e is not None:
            spans.calls.append((a, e, scheme_of_call(calls, i, schemes)))
    off = clocks.offsets.get(rank, 0.0)
    for k in range(len(inst)):
        last = stats.last_arrival[k]
        if last is None or rank not in inst.member_rank[k]:
            continue
        m = inst.member_rank[k].index(rank)
        a, e = inst.member_arrival[k][m], inst.member_end[k][m]
        if a is not None:
            stop = last - off if e is None else min(last - off, e)
            if stop > a:
                spans.wait.append((a, stop))
    return spans


def _kind(iv: Intervals, kinds: set[str] | frozenset[str]) -> Spans:
    return [(s, e) for k, s, e in zip(iv.kind, iv.start, iv.end, strict=True) if k in kinds]


def _cover(bounds: npt.NDArray[np.float64], spans: Spans) -> npt.NDArray[np.bool_]:
    """Which elementary segments [bounds[j], bounds[j+1]] the spans cover."""
    delta = np.zeros(len(bounds) + 1, dtype=np.int64)
    if spans:
        arr = np.asarray(spans, dtype=np.float64)
        np.add.at(delta, np.searchsorted(bounds, arr[:, 0]), 1)
        np.add.at(delta, np.searchsorted(bounds, arr[:, 1]), -1)
    return np.cumsum(delta)[: len(bounds) - 1] > 0


def _clip(spans: Spans, t0: float, t1: float) -> Spans:
    return [(max(s, t0), min(e, t1)) for s, e in spans if e > t0 and s < t1]


def classify(spans: RankSpans, t0: float, t1: float) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Microseconds per category in [t0, t1] (rank clock), and per scheme: overlapped/wait/exposed."""
    parts = {n: _clip(getattr(spans, n), t0, t1) for n in ("compute", "comm", "memory", "wait")}
    calls = sorted((max(s, t0), min(e, t1), sc) for s, e, sc in spans.calls if e > t0 and s < t1)
    pts = (
        [t0, t1] + [x for p in parts.values() for s, e in p for x in (s, e)] + [x for s, e, _ in calls for x in (s, e)]
    )
    bounds = np.unique(np.asarray(pts, dtype=np.float64))
    width = np.diff(bounds)
    comp, comm = _cover(bounds, parts["compute"]), _cover(bounds, parts["comm"])
    mem, wait = _cover(bounds, parts["memory"]), _cover(bounds, parts["wait"])
    cats = {
        "compute": comp & ~comm,
        "overlapped": comp & comm,
        "wait": ~comp & comm & wait,
        "exposed": ~comp & comm & ~wait,
        "memcpy": ~comp & ~comm & mem,
    }
    totals = {name: float(width[mask].sum()) for name, mask in cats.items()}
    totals["idle"] = max(0.0, (t1 - t0) - sum(totals.values()))
    owner = np.full(len(width), -1, dtype=np.int64)
    names: list[str] = []
    for s, e, sc in calls:  # earliest-started call first: it keeps the segments it covers
        if sc not in names:
            names.append(sc)
        i0, i1 = int(np.searchsorted(bounds, s)), int(np.searchsorted(bounds, e))
        seg = owner[i0:i1]
        seg[seg < 0] = names.index(sc)
    per_scheme: dict[str, dict[str, float]] = {}
    for cat in ("overlapped", "wait", "exposed"):
        mask = cats[cat]
        for code, sc in [*enumerate(names), (-1, UNATTRIBUTED)]:
            us = float(width[mask & (owner == code)].sum())
            if us > 0:
                per_scheme.setdefault(sc, {"overlapped": 0.0, "wait": 0.0, "exposed": 0.0})[cat] += us
    return totals, per_scheme


def step_breakdown(
    ranks: Mapping[int, RankInput],
    inst: Instances,
    stats: InstanceStats,
    clocks: ClockAlignment,
    schemes: Mapping[str, str] | None = None,
) -> Breakdown:
    """The breakdown of every profiled step of every rank (each rank's own step window and clock)."""
    out = Breakdown()
    schemes = schemes or {}
    for rank in sorted(ranks):
        data = ranks[rank]
        st = data.steps
        if not st.step:
            out.notes.append(f"rank {rank}: no profiler steps, no per-step breakdown")
            continue
        if not data.has_device:
            out.notes.append(f"rank {rank}: no device activity: compute is CPU ops, communication the calls' CPU time")
        spans = rank_spans(rank, data, inst, stats, clocks, schemes)
        for n, t0, t1 in zip(st.step, st.start, st.end, strict=True):
            totals, per_scheme = classify(spans, t0, t1)
            out.rank.append(rank)
            out.step.append(n)
            out.step_us.append(t1 - t0)
            out.compute_us.append(totals["compute"])
            out.overlapped_us.append(totals["overlapped"])
            out.wait_us.append(totals["wait"])
            out.exposed_us.append(totals["exposed"])
            out.memcpy_us.append(totals["memcpy"])
            out.idle_us.append(totals["idle"])
            htod, dtoh, busy = _memcpy_lane(data.intervals, t0, t1)
            out.htod_bytes.append(htod)
            out.dtoh_bytes.append(dtoh)
            out.memcpy_busy_us.append(busy)
            for sc, v in sorted(per_scheme.items()):
                out.by_scheme.append((rank, n, sc, v["overlapped"], v["wait"], v["exposed"]))
    return out


def _memcpy_lane(iv: Intervals, t0: float, t1: float) -> tuple[int, int, float]:
    """Host-to-device and device-to-host bytes of the copies starting in [t0, t1), and the time any
    memory operation runs there (GB/s per step = bytes / busy time)."""
    htod = dtoh = 0
    for k, s, b in zip(iv.kind, iv.start, iv.nbytes, strict=True):
        if t0 <= s < t1:
            htod += b if k == "memcpy_htod" else 0
            dtoh += b if k == "memcpy_dtoh" else 0
    spans = _clip(_kind(iv, MEMORY_KINDS), t0, t1)
    if not spans:
        return htod, dtoh, 0.0
    bounds = np.unique(np.asarray([x for sp in spans for x in sp], dtype=np.float64))
    return htod, dtoh, float(np.diff(bounds)[_cover(bounds, spans)].sum())


def comm_comp_overlap(iv: Intervals, before: float | None = None) -> float | None:
    """HTA's overlap ratio: time where communication and compute kernels both run, over the time
    communication kernels run (merged intervals); None without communication kernels. `before` keeps
    only intervals that start before it: HTA by default drops the last profiler step (the kernels
    launched after its start), so its default number is ours with before = the last step's start."""
    comm, comp = _kind(iv, {COMM}), _kind(iv, {COMPUTE})
    if before is not None:
        comm, comp = [x for x in comm if x[0] < before], [x for x in comp if x[0] < before]
    if not comm:
        return None
    pts = [x for s, e in comm + comp for x in (s, e)]
    bounds = np.unique(np.asarray(pts, dtype=np.float64))
    width = np.diff(bounds)
    c = _cover(bounds, comm)
    total = float(width[c].sum())
    return float(width[c & _cover(bounds, comp)].sum()) / total if total > EPS else None
