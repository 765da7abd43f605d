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
(the earliest-started call when several do; UNATTRIBUTED when no call does, e.g. a kernel the ingest
skipped, or the group has no scheme).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from commlens.contract.analysis import UNATTRIBUTED

from .clocks import ClockAlignment
from .instances import InstanceStats
from .matching import WORLD, Instances
from .model import COMM, COMPUTE, EPS, MEMORY_KINDS, Calls, Intervals, RankInput

CATEGORIES = ("compute", "overlapped", "wait", "exposed", "memcpy", "idle")
Spans = list[tuple[float, float]]


@dataclass
class RankSpans:
    """One rank's activity in its own clock, ready to classify any window."""

    compute: Spans
    comm: Spans
    memory: Spans
    wait: Spans
    calls: list[tuple[float, float, str]]  # (start, end, scheme)
    _index: dict[str, _SpanIndex] = field(default_factory=dict, repr=False)

    def window(self, name: str, t0: float, t1: float) -> npt.NDArray[np.float64]:
        """The spans of `name` (compute, comm, memory, wait) meeting [t0, t1], clipped to it, as rows
        (start, end)."""
        return self._index_of(name).clip(t0, t1)[0]

    def calls_in(self, t0: float, t1: float) -> list[tuple[float, float, str]]:
        """The calls meeting [t0, t1], clipped to it, earliest (clipped) start first."""
        rows, idx = self._index_of("calls").clip(t0, t1)
        return sorted((s, e, self.calls[i][2]) for (s, e), i in zip(rows.tolist(), idx.tolist(), strict=True))

    def _index_of(self, name: str) -> _SpanIndex:
        if name not in self._index:
            rows = [(a, e) for a, e, _ in self.calls] if name == "calls" else getattr(self, name)
            self._index[name] = _SpanIndex(rows)
        return self._index[name]


class _SpanIndex:
    """Spans sorted by start with the running maximum of their ends, so the spans meeting a window are
    found by two binary searches instead of a scan of the rank's whole run (a step, a path segment)."""

    def __init__(self, spans: Spans) -> None:
        arr = np.asarray(spans, dtype=np.float64).reshape(-1, 2)
        self.order = np.argsort(arr[:, 0], kind="stable")
        self.start = arr[self.order, 0]
        self.end = arr[self.order, 1]
        self.reach = np.maximum.accumulate(self.end) if len(self.end) else self.end

    def clip(self, t0: float, t1: float) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.intp]]:
        """The clipped rows meeting [t0, t1] and their positions in the spans given."""
        lo = int(np.searchsorted(self.reach, t0, side="right"))
        hi = int(np.searchsorted(self.start, t1, side="left"))
        s, e = self.start[lo:hi], self.end[lo:hi]
        keep = e > t0
        return np.column_stack((np.maximum(s[keep], t0), np.minimum(e[keep], t1))), self.order[lo:hi][keep]


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


def _cover(bounds: npt.NDArray[np.float64], spans: npt.NDArray[np.float64] | Spans) -> npt.NDArray[np.bool_]:
    """Which elementary segments [bounds[j], bounds[j+1]] the spans cover."""
    delta = np.zeros(len(bounds) + 1, dtype=np.int64)
    if len(spans):
        arr = np.asarray(spans, dtype=np.float64)
        np.add.at(delta, np.searchsorted(bounds, arr[:, 0]), 1)
        np.add.at(delta, np.searchsorted(bounds, arr[:, 1]), -1)
    return np.cumsum(delta)[: len(bounds) - 1] > 0


def classify(spans: RankSpans, t0: float, t1: float) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Microseconds per category in [t0, t1] (rank clock), and per scheme: overlapped/wait/exposed."""
    parts = {n: spans.window(n, t0, t1) for n in ("compute", "comm", "memory", "wait")}
    calls = spans.calls_in(t0, t1)
    call_pts = np.asarray([x for s, e, _ in calls for x in (s, e)], dtype=np.float64)
    bounds = np.unique(np.concatenate([np.asarray([t0, t1]), *(p.ravel() for p in parts.values()), call_pts]))
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
        copies = _copies(data.intervals)
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
            htod, dtoh, busy = _memcpy_lane(copies, spans, t0, t1)
            out.htod_bytes.append(htod)
            out.dtoh_bytes.append(dtoh)
            out.memcpy_busy_us.append(busy)
            for sc, v in sorted(per_scheme.items()):
                out.by_scheme.append((rank, n, sc, v["overlapped"], v["wait"], v["exposed"]))
    return out


_Copies = tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int64]]


def _copies(iv: Intervals) -> _Copies:
    """Start, host-to-device bytes and device-to-host bytes of each interval, sorted by start."""
    start = np.asarray(iv.start, dtype=np.float64)
    kind = np.asarray(iv.kind, dtype=object)
    nbytes = np.asarray(iv.nbytes, dtype=np.int64)
    order = np.argsort(start, kind="stable")
    return (
        start[order],
        np.where(kind == "memcpy_htod", nbytes, 0)[order],
        np.where(kind == "memcpy_dtoh", nbytes, 0)[order],
    )


def _memcpy_lane(copies: _Copies, spans: RankSpans, t0: float, t1: float) -> tuple[int, int, float]:
    """Host-to-device and device-to-host bytes of the copies starting in [t0, t1), and the time any
    memory operation runs there (GB/s per step = bytes / busy time)."""
    start, htod, dtoh = copies
    lo, hi = np.searchsorted(start, t0, side="left"), np.searchsorted(start, t1, side="left")
    moved = int(htod[lo:hi].sum()), int(dtoh[lo:hi].sum())
    mem = spans.window("memory", t0, t1)
    if not len(mem):
        return moved[0], moved[1], 0.0
    bounds = np.unique(mem.ravel())
    return moved[0], moved[1], float(np.diff(bounds)[_cover(bounds, mem)].sum())


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
