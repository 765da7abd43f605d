"""The chain of work across ranks that bounds a step.

Start at the step's end on the rank whose step ends last (reference clock). On the current rank at
time t, take the latest instance it took part in that ended by t: the span from that end to t is the
rank's own work; the instance's span from its last arrival to the end is the collective itself; then
continue on the rank that arrived last, at its arrival. Stop at the step's start (or when no earlier
instance exists, the rest of the rank's step is its work). Each span is classified with the breakdown's
precedence on its rank, so the path's time splits into compute, overlapped, wait, exposed, memcpy, idle
and per scheme.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from .breakdown import CATEGORIES, RankSpans
from .clocks import ClockAlignment
from .instances import InstanceStats
from .matching import Instances
from .model import EPS, F64, Ints, RankArrays
from .segments import WindowClasses, classify_columns


@dataclass
class PathSegment:
    rank: int
    start: float  # reference clock, µs
    end: float
    kind: str  # "work" | "collective"
    instance: int | None  # index into Instances for a collective segment


@dataclass
class CriticalPath:
    step: int
    start: float
    end: float
    segments: list[PathSegment] = field(default_factory=list)
    categories: dict[str, float] = field(default_factory=dict)  # µs per breakdown category on the path
    exposed_share_by_scheme: dict[str, float] = field(default_factory=dict)  # (wait + exposed) / step
    note: str | None = None


def walk_paths(
    ranks: Mapping[int, RankArrays], inst: Instances, stats: InstanceStats, clocks: ClockAlignment
) -> list[CriticalPath]:
    """Every profiled step's path, unclassified (PathWindows classifies it). Step windows and member end
    times are sorted by (step, rank) once, so each step of the walk is a binary search: a scan of the run
    per step would make the whole quadratic in the number of steps."""
    win = _StepWindows(ranks, clocks)
    ends = _MemberEnds(inst, stats, clocks)
    return [_walk(n, win, ends, stats, clocks) for n in win.steps.tolist()]


class _StepWindows:
    """Every rank's step windows on the reference clock, sorted by (step, rank)."""

    def __init__(self, ranks: Mapping[int, RankArrays], clocks: ClockAlignment) -> None:
        parts = [(r, d.steps) for r, d in ranks.items() if len(d.steps)]
        step = np.concatenate([st.step for _, st in parts]) if parts else np.zeros(0, dtype=np.int64)
        rank = np.concatenate([np.full(len(st), r, dtype=np.int64) for r, st in parts]) if parts else step
        off = clocks.offset_of(rank)
        start = np.concatenate([st.start for _, st in parts]) + off if parts else np.zeros(0)
        end = np.concatenate([st.end for _, st in parts]) + off if parts else np.zeros(0)
        # a rank listing a step twice keeps its last window, as a dict keyed by (step, rank) would
        o = np.lexsort((np.arange(len(step)), rank, step))
        keep = np.r_[(step[o][1:] != step[o][:-1]) | (rank[o][1:] != rank[o][:-1]), True] if len(o) else o > 0
        o = o[keep]
        self.step, self.rank, self.start, self.end = step[o], rank[o], start[o], end[o]
        first = np.r_[True, self.step[1:] != self.step[:-1]] if len(o) else np.zeros(0, dtype=bool)
        self.steps = self.step[first]
        self.lo = np.flatnonzero(first)
        self.hi = np.r_[self.lo[1:], len(o)].astype(np.int64)

    def of(self, j: int) -> tuple[Ints, F64, F64]:
        a, b = int(self.lo[j]), int(self.hi[j])
        return self.rank[a:b], self.start[a:b], self.end[a:b]


class _MemberEnds:
    """The end (reference clock) of every member of every instance with a last arrival, sorted by
    (step, rank, end, instance): the walk's candidates on one rank of one step are a slice."""

    def __init__(self, inst: Instances, stats: InstanceStats, clocks: ClockAlignment) -> None:
        keep = (stats.last_rank_code[inst.m_inst] >= 0) & inst.has_step[inst.m_inst] & ~np.isnan(inst.m_end)
        k = inst.m_inst[keep]
        rank = inst.m_rank[keep]
        end = inst.m_end[keep] + clocks.offset_of(rank)
        step = inst.steps[k]
        o = np.lexsort((k, end, rank, step))
        self.step, self.rank, self.end, self.inst = step[o], rank[o], end[o], k[o]

        self.first = np.r_[True, self.step[1:] != self.step[:-1]] if len(o) else np.zeros(0, dtype=bool)
        self.steps = self.step[self.first]
        self.lo = np.flatnonzero(self.first)
        self.hi = np.r_[self.lo[1:], len(o)].astype(np.int64)

    def of_step(self, step: int) -> _StepEnds:
        j = int(np.searchsorted(self.steps, step))
        if j == len(self.steps) or self.steps[j] != step:
            return _StepEnds([], [], [])
        a, b = int(self.lo[j]), int(self.hi[j])
        return _StepEnds(self.rank[a:b].tolist(), self.end[a:b].tolist(), self.inst[a:b].tolist())


class _StepEnds:
    """One step's member ends as Python lists sorted by (rank, end, instance), for the walk's lookups."""

    def __init__(self, rank: list[int], end: list[float], inst: list[int]) -> None:
        self.rank, self.end, self.inst = rank, end, inst

    def latest(self, rank: int, t: float, after: float) -> int | None:
        """The position of the latest (end, instance) of `rank` with after < end <= t."""
        a = bisect.bisect_left(self.rank, rank)
        b = bisect.bisect_right(self.rank, rank, a)
        q = bisect.bisect_right(self.end, t, a, b) - 1
        return q if q >= a and self.end[q] > after else None


def _walk(
    step: int,
    win: _StepWindows,
    ends: _MemberEnds,
    stats: InstanceStats,
    clocks: ClockAlignment,
) -> CriticalPath:
    """One step's path, unclassified."""
    j = int(np.searchsorted(win.steps, step))
    ranks, starts, stops = win.of(j)
    start = float(starts.min())
    top = np.lexsort((-ranks, stops))[-1]  # the latest end, the lowest rank among equal ones
    rank, end = int(ranks[top]), float(stops[top])
    path = CriticalPath(step, start, end)
    if not clocks.trusted:
        path.note = f"no path across ranks: {clocks.reason}"
    here = ends.of_step(step) if clocks.trusted else _StepEnds([], [], [])
    t = end
    while t > start + EPS:
        # equal ends: the latest instance, as max() over (end, instance) pairs takes it
        pick = here.latest(rank, t + EPS, start)
        if pick is None:
            at = np.flatnonzero(ranks == rank)
            begin = float(starts[at[0]]) if len(at) else start
            path.segments.append(PathSegment(rank, max(start, begin), t, "work", None))
            break
        left, k = here.end[pick], here.inst[pick]
        if t - left > EPS:
            path.segments.append(PathSegment(rank, left, t, "work", None))
        last = float(stats.last[k])
        nxt = int(stats.last_rank_code[k])
        path.segments.append(PathSegment(rank, max(last, start), left, "collective", k))
        if last >= t - EPS:
            break  # no progress: the data is inconsistent
        rank, t = nxt, last
    return path


def _windows(path: CriticalPath, present: Collection[int]) -> list[tuple[int, float, float]]:
    """The path's segments as windows per rank; consecutive segments on one rank are one window (the
    walk stays on a rank that keeps arriving last)."""
    windows: list[tuple[int, float, float]] = []
    for seg in path.segments:  # latest first: a segment ends where the one before it in the list starts
        if seg.rank not in present or seg.end <= seg.start:
            continue
        if windows and windows[-1][0] == seg.rank and abs(windows[-1][1] - seg.end) <= EPS:
            windows[-1] = (seg.rank, seg.start, windows[-1][2])
        else:
            windows.append((seg.rank, seg.start, seg.end))
    return windows


class PathWindows:
    """The paths' windows per rank (in that rank's clock), to be classified one rank at a time (a rank's
    spans need not outlive its turn), then summed per path in the path's order."""

    def __init__(self, paths: list[CriticalPath], present: Collection[int], clocks: ClockAlignment) -> None:
        asked: dict[int, list[tuple[float, float]]] = defaultdict(list)
        path, rank, pos = [], [], []  # every window in path order: its path, rank and place in asked[rank]
        for k, p in enumerate(paths):
            for r, start, end in _windows(p, present):
                off = clocks.offsets.get(r, 0.0)
                path.append(k)
                rank.append(r)
                pos.append(len(asked[r]))
                asked[r].append((start - off, end - off))
        self._asked = {r: np.asarray(w, dtype=np.float64).reshape(-1, 2) for r, w in asked.items()}
        self.ranks = sorted(self._asked)
        self._path = np.asarray(path, dtype=np.int64)
        self._rank = np.asarray(rank, dtype=np.int64)
        self._pos = np.asarray(pos, dtype=np.int64)

    def classify(self, rank: int, spans: RankSpans) -> WindowClasses:
        w = self._asked[rank]
        return classify_columns(spans, w[:, 0], w[:, 1])

    def classify_into(self, paths: list[CriticalPath], classes: Mapping[int, WindowClasses]) -> None:
        """Each path's categories and exposed share per scheme from its windows' classes. Sums run in the
        path's window order (np.add.at adds in the order given), as a loop over the windows would."""
        n = len(paths)
        cats = np.zeros((n, len(CATEGORIES)), dtype=np.float64)
        names = sorted({sc for c in classes.values() for sc in c.scheme})
        code = {sc: i for i, sc in enumerate(names)}
        exposed = np.zeros(n * len(names), dtype=np.float64)
        seen = np.zeros(n * len(names), dtype=bool)
        values = np.zeros((len(self._path), len(CATEGORIES)), dtype=np.float64)
        rows_of = np.zeros(len(self._path), dtype=np.int64)  # each window's scheme rows: how many
        first = np.zeros(len(self._path), dtype=np.int64)  # and the first (in its rank's classes)
        for r, c in classes.items():
            mine = np.flatnonzero(self._rank == r)
            at = self._pos[mine]
            values[mine] = np.stack([c.totals[cat][at] for cat in CATEGORIES], axis=1)
            lo, hi = np.searchsorted(c.win, at, side="left"), np.searchsorted(c.win, at, side="right")
            first[mine], rows_of[mine] = lo, hi - lo
        np.add.at(cats, self._path, values)
        if rows_of.any():
            window = np.repeat(np.arange(len(self._path)), rows_of)
            row = first[window] + np.arange(len(window)) - np.repeat(np.cumsum(rows_of) - rows_of, rows_of)
            wait, expo, cell = np.zeros(len(row)), np.zeros(len(row)), np.zeros(len(row), dtype=np.int64)
            for r, c in classes.items():
                mine = np.flatnonzero(self._rank[window] == r)
                at = row[mine]
                wait[mine], expo[mine] = c.wait[at], c.exposed[at]
                codes = np.asarray([code[sc] for sc in c.scheme], dtype=np.int64)
                cell[mine] = self._path[window[mine]] * len(names) + codes[at]
            # by scheme, (sum + wait) + exposed per window, in the path's order
            np.add.at(exposed, np.repeat(cell, 2), np.stack([wait, expo], axis=1).ravel())
            seen[cell] = True
        by_path, seen_by_path = exposed.reshape(n, len(names)), seen.reshape(n, len(names))
        for k, p in enumerate(paths):
            p.categories = dict(zip(CATEGORIES, cats[k].tolist(), strict=True))
            length = p.end - p.start
            shares = {names[j]: by_path[k, j] / length for j in np.flatnonzero(seen_by_path[k]).tolist()}
            p.exposed_share_by_scheme = {sc: float(v) for sc, v in shares.items()} if length > 0 else {}
