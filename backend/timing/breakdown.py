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

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from commlens.contract.analysis import UNATTRIBUTED

from .clocks import ClockAlignment
from .instances import InstanceStats
from .matching import WORLD, Instances
from .model import COMM, COMPUTE, EPS, MEMORY_KINDS, Calls, Intervals, RankInput
from .segments import classify_windows, memory_busy

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

    def index_of(self, name: str) -> _SpanIndex:
        """The index of `name`'s spans (compute, comm, memory, wait, calls), built on first use."""
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


def wait_spans(inst: Instances, stats: InstanceStats, clocks: ClockAlignment) -> dict[int, Spans]:
    """Per rank (its own clock), the spans it spent in instances before their last member arrived: one
    pass over the instances for all ranks."""
    out: dict[int, Spans] = defaultdict(list)
    offsets = clocks.offsets
    for last, ranks, arrivals, ends in zip(
        stats.last_arrival, inst.member_rank, inst.member_arrival, inst.member_end, strict=True
    ):
        if last is None:
            continue
        for rank, a, e in zip(ranks, arrivals, ends, strict=True):
            if a is not None:
                off = offsets.get(rank, 0.0)
                stop = last - off if e is None else min(last - off, e)
                if stop > a:
                    out[rank].append((a, stop))
    return out


def rank_spans(data: RankInput, waits: Spans, schemes: Mapping[str, str]) -> RankSpans:
    """One rank's spans; `waits` from wait_spans."""
    iv = data.intervals
    calls = data.calls
    spans = RankSpans(_kind(iv, {COMPUTE}), _kind(iv, {COMM}), _kind(iv, MEMORY_KINDS), waits, [])
    for i in range(len(calls.seq)):
        a, e = calls.arrival[i], calls.end[i]
        if a is not None and e is not None:
            spans.calls.append((a, e, scheme_of_call(calls, i, schemes)))
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
    return classify_windows(spans, np.asarray([t0]), np.asarray([t1]))[0]


def step_breakdown(ranks: Mapping[int, RankInput], spans: Mapping[int, RankSpans]) -> Breakdown:
    """The breakdown of every profiled step of every rank (each rank's own step window and clock)."""
    out = Breakdown()
    for rank in sorted(ranks):
        data = ranks[rank]
        st = data.steps
        if not st.step:
            out.notes.append(f"rank {rank}: no profiler steps, no per-step breakdown")
            continue
        if not data.has_device:
            out.notes.append(f"rank {rank}: no device activity: compute is CPU ops, communication the calls' CPU time")
        t0s = np.asarray(st.start, dtype=np.float64)
        t1s = np.asarray(st.end, dtype=np.float64)
        htod, dtoh = _moved(_copies(data.intervals), t0s, t1s)
        busy = memory_busy(spans[rank], t0s, t1s).tolist()
        classes = classify_windows(spans[rank], t0s, t1s)
        for j, (n, t0, t1) in enumerate(zip(st.step, st.start, st.end, strict=True)):
            totals, per_scheme = classes[j]
            out.rank.append(rank)
            out.step.append(n)
            out.step_us.append(t1 - t0)
            out.compute_us.append(totals["compute"])
            out.overlapped_us.append(totals["overlapped"])
            out.wait_us.append(totals["wait"])
            out.exposed_us.append(totals["exposed"])
            out.memcpy_us.append(totals["memcpy"])
            out.idle_us.append(totals["idle"])
            out.htod_bytes.append(htod[j])
            out.dtoh_bytes.append(dtoh[j])
            out.memcpy_busy_us.append(busy[j])
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


def _moved(copies: _Copies, t0s: npt.NDArray[np.float64], t1s: npt.NDArray[np.float64]) -> tuple[list[int], list[int]]:
    """Per window, host-to-device and device-to-host bytes of the copies starting in [t0, t1) (GB/s per
    step = bytes / the memory busy time, segments.memory_busy)."""
    start, htod, dtoh = copies
    lo, hi = np.searchsorted(start, t0s, side="left"), np.searchsorted(start, t1s, side="left")
    h = np.concatenate([[0], np.cumsum(htod)])
    d = np.concatenate([[0], np.cumsum(dtoh)])
    return (h[hi] - h[lo]).tolist(), (d[hi] - d[lo]).tolist()


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
