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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .clocks import ClockAlignment
from .instances import InstanceStats
from .matching import Instances
from .memcpy_lane import LANE_FIELDS, Lane, memcpy_lane
from .model import (
    COMM,
    COMPUTE,
    EPS,
    F64,
    KIND_CODE,
    MEMORY_KINDS,
    CallTable,
    IntervalArrays,
    Intervals,
    Ints,
    RankArrays,
)
from .segments import classify_columns, memory_busy

CATEGORIES = ("compute", "overlapped", "wait", "exposed", "memcpy", "idle")
Spans = list[tuple[float, float]]


def _pairs(spans: Spans | npt.NDArray[np.float64]) -> F64:
    return np.asarray(spans, dtype=np.float64).reshape(-1, 2)


class RankSpans:
    """One rank's activity in its own clock, ready to classify any window: compute, comm, memory, wait
    and its calls' spans, each kept only as its index (sorted by start), and each call's scheme as a
    code into the sorted `scheme_names`. Inputs are (n, 2) arrays of (start, end); the calls may come
    and each kind may come as (starts, ends) columns, kept without a copy when in start order."""

    def __init__(
        self,
        compute: F64 | tuple[F64, F64],
        comm: F64 | tuple[F64, F64],
        memory: F64 | tuple[F64, F64],
        wait: F64 | tuple[F64, F64],
        call_span: F64 | tuple[F64, F64],
        call_scheme: Ints,
        scheme_names: list[str],
    ) -> None:
        given = {"compute": compute, "comm": comm, "memory": memory, "wait": wait, "calls": call_span}
        self._index = {name: _SpanIndex(spans, keep_order=name == "calls") for name, spans in given.items()}
        self.call_scheme = call_scheme
        self.scheme_names = scheme_names

    @classmethod
    def of_rows(
        cls, compute: Spans, comm: Spans, memory: Spans, wait: Spans, calls: Sequence[tuple[float, float, str]]
    ) -> RankSpans:
        """From Python rows; calls as (start, end, scheme)."""
        names = sorted({sc for _, _, sc in calls})
        code = np.asarray([names.index(sc) for _, _, sc in calls], dtype=np.int64)
        span = _pairs([(a, e) for a, e, _ in calls])
        return cls(_pairs(compute), _pairs(comm), _pairs(memory), _pairs(wait), span, code, names)

    def spans(self, name: str) -> F64:
        """`name`'s spans as (start, end) rows, sorted by start."""
        ix = self._index[name]
        return np.stack([ix.start, ix.end], axis=1)

    @property
    def calls(self) -> list[tuple[float, float, str]]:
        ix = self._index["calls"]
        codes = self.call_scheme[ix.order].tolist()
        return [(a, e, self.scheme_names[c]) for a, e, c in zip(ix.start.tolist(), ix.end.tolist(), codes, strict=True)]

    def index_of(self, name: str) -> _SpanIndex:
        """The index of `name`'s spans (compute, comm, memory, wait, calls)."""
        return self._index[name]


class _SpanIndex:
    """Spans sorted by start with the running maximum of their ends, so the spans meeting a window are
    found by two binary searches instead of a scan of the rank's whole run (a step, a path segment).
    `order` (the given position of each) is kept only where asked: the calls, for their schemes."""

    def __init__(self, spans: F64 | tuple[F64, F64], keep_order: bool = True) -> None:
        if isinstance(spans, tuple):  # (starts, ends) columns: taken as they are when already in order
            s, e = (np.asarray(x, dtype=np.float64) for x in spans)
        else:
            arr = _pairs(spans)
            s, e = arr[:, 0], arr[:, 1]
        if len(s) < 2 or bool((s[1:] >= s[:-1]).all()):  # sorted already (calls in issue order):
            self.start, self.end = np.ascontiguousarray(s), np.ascontiguousarray(e)  # as a stable argsort gives
            order = np.arange(len(s), dtype=np.intp) if keep_order else None
        else:
            order = np.argsort(s, kind="stable")
            self.start = s[order]
            self.end = e[order]
        self.order = order if order is not None and keep_order else np.zeros(0, dtype=np.intp)
        self.reach = np.maximum.accumulate(self.end) if len(self.end) else self.end


@dataclass
class Breakdown:
    """One row per (rank, step) as columns; `scheme_*` rows: (rank, step, scheme, overlapped, wait,
    exposed), per (rank, step) in step order, schemes by name."""

    rank: Ints
    step: Ints
    step_us: F64
    compute_us: F64
    overlapped_us: F64
    wait_us: F64
    exposed_us: F64
    memcpy_us: F64
    idle_us: F64
    htod_bytes: Ints  # memcpy lane: copies starting in the step
    dtoh_bytes: Ints
    memcpy_busy_us: F64  # time any memcpy/memset runs (overlaps included)
    scheme_rank: Ints
    scheme_step: Ints
    scheme: list[str]
    scheme_overlapped: F64
    scheme_wait: F64
    scheme_exposed: F64
    notes: list[str] = field(default_factory=list)
    memcpy: Lane = field(default_factory=dict)  # the memcpy lane's rows (memcpy_lane.LANE_FIELDS), by rank

    @property
    def by_scheme(self) -> list[tuple[int, int, str, float, float, float]]:
        return list(
            zip(
                self.scheme_rank.tolist(),
                self.scheme_step.tolist(),
                self.scheme,
                self.scheme_overlapped.tolist(),
                self.scheme_wait.tolist(),
                self.scheme_exposed.tolist(),
                strict=True,
            )
        )


def wait_spans(inst: Instances, stats: InstanceStats, clocks: ClockAlignment) -> dict[int, F64]:
    """Per rank (its own clock), the spans it spent in instances before their last member arrived, in
    instance order: one pass over the members for all ranks."""
    last = stats.last[inst.m_inst]
    a = inst.m_arrival
    stop = last - clocks.offset_of(inst.m_rank)
    stop = np.where(np.isnan(inst.m_end), stop, np.minimum(stop, inst.m_end))
    keep = ~np.isnan(last) & ~np.isnan(a) & (stop > a)
    ranks, a, stop = inst.m_rank[keep], a[keep], stop[keep]
    order = np.argsort(ranks, kind="stable")
    ranks, a, stop = ranks[order], a[order], stop[order]
    cut = np.flatnonzero(ranks[1:] != ranks[:-1]) + 1
    return {
        int(ranks[x]): np.stack([a[x:y], stop[x:y]], axis=1)
        for x, y in zip(np.r_[0, cut].tolist(), np.r_[cut, len(ranks)].tolist(), strict=True)
        if y > x
    }


def rank_spans(
    data: RankArrays, waits: F64, calls: CallTable, rows: Ints | slice, scheme: Ints, names: list[str]
) -> RankSpans:
    """One rank's spans; `waits` from wait_spans; `rows` its calls in the CallTable (a slice where they
    are consecutive: no copy), `scheme` every call's scheme as a code into the sorted `names`."""
    iv = data.intervals
    a, e = calls.arrival[rows], calls.end[rows]
    timed = ~np.isnan(a)
    timed &= ~np.isnan(e)
    every = bool(timed.all())
    span = (a, e) if every else (a[timed], e[timed])  # views of the CallTable where every call is timed
    del a, e
    return RankSpans(
        _kind_columns(iv, {COMPUTE}),
        _kind_columns(iv, {COMM}),
        _kind_columns(iv, MEMORY_KINDS),
        (waits[:, 0], waits[:, 1]) if len(waits) else _pairs(waits),
        span,
        scheme[rows] if every else scheme[rows][timed],
        names,
    )


def _kind_columns(iv: IntervalArrays, kinds: set[str] | frozenset[str]) -> tuple[F64, F64]:
    """The (starts, ends) of the intervals of these kinds, as columns (no (n, 2) copy to split again)."""
    sel = iv.of(kinds)
    return iv.start[sel], iv.end[sel]


def _kind(iv: IntervalArrays, kinds: set[str] | frozenset[str]) -> F64:
    sel = iv.of(kinds)
    return np.stack([iv.start[sel], iv.end[sel]], axis=1)


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
    return classify_columns(spans, np.asarray([t0]), np.asarray([t1])).as_dicts()[0]


_FIELDS = (
    "rank",
    "step",
    "step_us",
    *(f"{c}_us" for c in CATEGORIES),
    "htod_bytes",
    "dtoh_bytes",
    "memcpy_busy_us",
    "scheme_rank",
    "scheme_step",
    "scheme_overlapped",
    "scheme_wait",
    "scheme_exposed",
)
_INT_FIELDS = frozenset({"rank", "step", "htod_bytes", "dtoh_bytes", "scheme_rank", "scheme_step"})


@dataclass
class RankBreakdown:
    """One rank's rows of the Breakdown (its `_FIELDS` columns, its schemes, its notes)."""

    cols: dict[str, npt.NDArray[np.generic]]
    scheme: list[str]
    notes: list[str]
    memcpy: Lane


def rank_breakdown(rank: int, data: RankArrays, spans: RankSpans) -> RankBreakdown:
    """The breakdown of every profiled step of one rank (its own step windows and clock)."""
    st = data.steps
    if not len(st):
        return RankBreakdown(
            {}, [], [f"rank {rank}: no profiler steps, no per-step breakdown"], memcpy_lane(rank, data)
        )
    notes = []
    if not data.has_device:
        notes.append(f"rank {rank}: no device activity: compute is CPU ops, communication the calls' CPU time")
    t0s, t1s = st.start, st.end
    htod, dtoh = _moved(_copies(data.intervals), t0s, t1s)
    c = classify_columns(spans, t0s, t1s)
    cols: dict[str, npt.NDArray[np.generic]] = {
        "rank": np.full(len(st), rank, dtype=np.int64),
        "step": st.step,
        "step_us": t1s - t0s,
    }
    for cat in CATEGORIES:
        cols[f"{cat}_us"] = c.totals[cat]
    cols |= {
        "htod_bytes": htod,
        "dtoh_bytes": dtoh,
        "memcpy_busy_us": memory_busy(spans, t0s, t1s),
        "scheme_rank": np.full(len(c.win), rank, dtype=np.int64),
        "scheme_step": st.step[c.win],
        "scheme_overlapped": c.overlapped,
        "scheme_wait": c.wait,
        "scheme_exposed": c.exposed,
    }
    return RankBreakdown(cols, list(c.scheme), notes, memcpy_lane(rank, data))


def joined_breakdown(parts: Sequence[RankBreakdown]) -> Breakdown:
    """The Breakdown of the ranks' parts (rank_breakdown), in the order given (the analysis: by rank)."""
    out: dict[str, Any] = {
        f: np.concatenate(vals)
        if (vals := [p.cols[f] for p in parts if p.cols])
        else np.zeros(0, dtype=np.int64 if f in _INT_FIELDS else np.float64)
        for f in _FIELDS
    }
    lane = {f: [v for p in parts for v in p.memcpy[f]] for f in LANE_FIELDS}
    scheme = [sc for p in parts for sc in p.scheme]
    return Breakdown(**out, scheme=scheme, notes=[n for p in parts for n in p.notes], memcpy=lane)


_Copies = tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int64]]


def _copies(iv: IntervalArrays) -> _Copies:
    """Start, host-to-device bytes and device-to-host bytes of each copy interval, sorted by start (the
    other intervals move no bytes: left out, they cost no sort of every kernel)."""
    sel = np.flatnonzero(iv.of({"memcpy_htod", "memcpy_dtoh"}))
    start, kind, nbytes = iv.start[sel], iv.kind[sel], iv.nbytes[sel]
    order = np.argsort(start, kind="stable")
    return (
        start[order],
        np.where(kind == KIND_CODE["memcpy_htod"], nbytes, 0)[order],
        np.where(kind == KIND_CODE["memcpy_dtoh"], nbytes, 0)[order],
    )


def _moved(copies: _Copies, t0s: F64, t1s: F64) -> tuple[Ints, Ints]:
    """Per window, host-to-device and device-to-host bytes of the copies starting in [t0, t1) (GB/s per
    step = bytes / the memory busy time, segments.memory_busy)."""
    start, htod, dtoh = copies
    lo, hi = np.searchsorted(start, t0s, side="left"), np.searchsorted(start, t1s, side="left")
    h = np.concatenate([[0], np.cumsum(htod)]).astype(np.int64)
    d = np.concatenate([[0], np.cumsum(dtoh)]).astype(np.int64)
    return h[hi] - h[lo], d[hi] - d[lo]


def comm_comp_overlap(iv: Intervals | IntervalArrays, before: float | None = None) -> float | None:
    """HTA's overlap ratio: time where communication and compute kernels both run, over the time
    communication kernels run (merged intervals); None without communication kernels. `before` keeps
    only intervals that start before it: HTA by default drops the last profiler step (the kernels
    launched after its start), so its default number is ours with before = the last step's start."""
    arrays = IntervalArrays.of_columns(iv)
    comm, comp = _kind(arrays, {COMM}), _kind(arrays, {COMPUTE})
    if before is not None:
        comm, comp = comm[comm[:, 0] < before], comp[comp[:, 0] < before]
    if not len(comm):
        return None
    bounds = np.unique(np.concatenate([comm, comp]).ravel())
    width = np.diff(bounds)
    c = _cover(bounds, comm)
    total = float(width[c].sum())
    return float(width[c & _cover(bounds, comp)].sum()) / total if total > EPS else None
