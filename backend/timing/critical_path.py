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

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .breakdown import CATEGORIES, RankSpans
from .clocks import ClockAlignment
from .instances import InstanceStats
from .matching import Instances
from .model import EPS, RankInput
from .segments import classify_windows


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


def critical_paths(
    ranks: Mapping[int, RankInput],
    spans: Mapping[int, RankSpans],
    inst: Instances,
    stats: InstanceStats,
    clocks: ClockAlignment,
) -> list[CriticalPath]:
    """Every profiled step's path. Step windows and instances are indexed by step once: a scan of the
    run per step would make the whole quadratic in the number of steps."""
    windows: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
    for r, data in ranks.items():
        st = data.steps
        for n, s, e in zip(st.step, st.start, st.end, strict=True):
            windows[n][r] = (clocks.to_reference(r, s), clocks.to_reference(r, e))
    by_step: dict[int | None, list[int]] = defaultdict(list)
    for k, (step, last) in enumerate(zip(inst.step, stats.last_rank, strict=True)):
        if last is not None:
            by_step[step].append(k)
    paths = [_walk(n, windows[n], by_step.get(n, []), inst, stats, clocks) for n in sorted(windows)]
    _classify_paths(paths, spans, clocks)
    return paths


def _walk(
    step: int,
    windows: Mapping[int, tuple[float, float]],
    instances: Sequence[int],
    inst: Instances,
    stats: InstanceStats,
    clocks: ClockAlignment,
) -> CriticalPath:
    """One step's path, unclassified: `windows` are the ranks' step windows on the reference clock, `instances` the
    step's instances that have a last arrival, in instance order."""
    if not windows:
        return CriticalPath(step, 0.0, 0.0, note=f"step {step} is on no rank")
    start = min(s for s, _ in windows.values())
    rank = max(windows, key=lambda r: (windows[r][1], -r))
    end = windows[rank][1]
    path = CriticalPath(step, start, end)
    if not clocks.trusted:
        path.note = f"no path across ranks: {clocks.reason}"
    ends: dict[int, list[tuple[float, int]]] = {}
    for k in instances:
        for r, end_r in zip(inst.member_rank[k], inst.member_end[k], strict=True):
            if end_r is not None:
                ends.setdefault(r, []).append((clocks.to_reference(r, end_r), k))
    t = end
    while t > start + EPS:
        cands = [(x, k) for x, k in ends.get(rank, []) if start < x <= t + EPS] if clocks.trusted else []
        if not cands:
            path.segments.append(PathSegment(rank, max(start, windows.get(rank, (start, t))[0]), t, "work", None))
            break
        left, k = max(cands)
        if t - left > EPS:
            path.segments.append(PathSegment(rank, left, t, "work", None))
        last = stats.last_arrival[k]
        nxt = stats.last_rank[k]
        assert last is not None and nxt is not None
        path.segments.append(PathSegment(rank, max(last, start), left, "collective", k))
        if last >= t - EPS:
            break  # no progress: the data is inconsistent
        rank, t = nxt, last
    return path


def _windows(path: CriticalPath, spans: Mapping[int, RankSpans]) -> list[tuple[int, float, float]]:
    """The path's segments as windows per rank; consecutive segments on one rank are one window (the
    walk stays on a rank that keeps arriving last)."""
    windows: list[tuple[int, float, float]] = []
    for seg in path.segments:  # latest first: a segment ends where the one before it in the list starts
        if seg.rank not in spans or seg.end <= seg.start:
            continue
        if windows and windows[-1][0] == seg.rank and abs(windows[-1][1] - seg.end) <= EPS:
            windows[-1] = (seg.rank, seg.start, windows[-1][2])
        else:
            windows.append((seg.rank, seg.start, seg.end))
    return windows


def _classify_paths(paths: list[CriticalPath], spans: Mapping[int, RankSpans], clocks: ClockAlignment) -> None:
    """Each path's windows classified on their rank (in that rank's clock), all windows of a rank at
    once, then summed per path in the path's order."""
    per_path = [_windows(p, spans) for p in paths]
    asked: dict[int, list[tuple[float, float]]] = defaultdict(list)
    where: list[list[tuple[int, int]]] = []
    for windows in per_path:
        where.append([])
        for rank, start, end in windows:
            off = clocks.offsets.get(rank, 0.0)
            where[-1].append((rank, len(asked[rank])))
            asked[rank].append((start - off, end - off))
    classes = {
        r: classify_windows(spans[r], np.asarray([a for a, _ in w]), np.asarray([b for _, b in w]))
        for r, w in asked.items()
    }
    for path, places in zip(paths, where, strict=True):
        cats = dict.fromkeys(CATEGORIES, 0.0)
        by_scheme: dict[str, float] = {}
        for rank, i in places:
            totals, per_scheme = classes[rank][i]
            for c, v in totals.items():
                cats[c] += v
            for sc, parts in per_scheme.items():
                by_scheme[sc] = by_scheme.get(sc, 0.0) + parts["wait"] + parts["exposed"]
        path.categories = cats
        length = path.end - path.start
        path.exposed_share_by_scheme = {sc: v / length for sc, v in sorted(by_scheme.items())} if length > 0 else {}
