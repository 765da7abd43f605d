"""Many windows of one rank classified at once (breakdown.classify's rule) with column operations.

A run of 10M calls has over a million (rank, step) windows; numpy's per-call overhead on each window was
most of the analysis. Here every window's clipped spans, elementary segments and coverage are computed
over flat arrays (window id + value), and per-window sums use `segment_sum`, which adds in numpy's own
pairwise order, so every number is bit-for-bit the one `ndarray.sum()` gives on the window alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from commlens.contract.analysis import UNATTRIBUTED

F64 = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


class SortedSpans(Protocol):
    """Spans sorted by start, the running maximum of their ends, and their positions as given."""

    @property
    def start(self) -> F64: ...
    @property
    def end(self) -> F64: ...
    @property
    def reach(self) -> F64: ...
    @property
    def order(self) -> npt.NDArray[np.intp]: ...


class RankSpans(Protocol):
    """What breakdown.RankSpans offers: its calls (start, end, scheme) and each kind's sorted spans."""

    @property
    def calls(self) -> Sequence[tuple[float, float, str]]: ...
    def index_of(self, name: str) -> SortedSpans: ...


_BLOCK = 128  # numpy's pairwise summation block


def segment_sum(values: F64, counts: Ints) -> F64:
    """Sum of each consecutive run of `counts[j]` values, in the order `values[a:b].sum()` adds them
    (numpy's pairwise summation: 8 accumulators inside a block of 128, halves above it)."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    out = np.zeros(len(counts), dtype=np.float64)
    small = np.flatnonzero(counts < 8)
    for p in range(7):
        sel = small[counts[small] > p]
        if not len(sel):
            break
        out[sel] += values[starts[sel] + p]
    mid = np.flatnonzero((counts >= 8) & (counts <= _BLOCK))
    if len(mid):
        n, s = counts[mid], starts[mid]
        acc = values[s[:, None] + np.arange(8)]
        full = n - n % 8
        for b in range(1, _BLOCK // 8):
            sel = np.flatnonzero(8 * b < full)
            if not len(sel):
                break
            acc[sel] += values[s[sel, None] + 8 * b + np.arange(8)]
        res = ((acc[:, 0] + acc[:, 1]) + (acc[:, 2] + acc[:, 3])) + ((acc[:, 4] + acc[:, 5]) + (acc[:, 6] + acc[:, 7]))
        for t in range(7):
            sel = np.flatnonzero(n % 8 > t)
            if not len(sel):
                break
            res[sel] += values[s[sel] + full[sel] + t]
        out[mid] = res
    for j in np.flatnonzero(counts > _BLOCK).tolist():
        out[j] = values[starts[j] : starts[j] + counts[j]].sum()
    return out


def sparse_sum(n: int, lo: int, vals: Sequence[float]) -> float:
    """What `x.sum()` gives for a length-n array x that is zero outside [lo, lo + len(vals)) and holds
    `vals` there, in O(log n + len(vals)): numpy's pairwise tree, its all-zero subtrees skipped."""
    hi = lo + len(vals)

    def rec(a: int, m: int) -> float:  # the sum of positions [a, a + m)
        if hi <= a or lo >= a + m:
            return 0.0
        if m < 8:
            res = 0.0
            for i in range(max(a, lo), min(a + m, hi)):
                res += vals[i - lo]
            return res
        if m <= 128:
            r = [0.0] * 8
            full = m - m % 8
            for i in range(max(a, lo), min(a + full, hi)):
                r[(i - a) % 8] += vals[i - lo]
            res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
            for i in range(max(a + full, lo), min(a + m, hi)):
                res += vals[i - lo]
            return res
        m2 = m // 2
        m2 -= m2 % 8
        return rec(a, m2) + rec(a + m2, m - m2)

    return rec(0, n)


def _clip_many(starts: F64, reach: F64, ends: F64, t0: F64, t1: F64) -> tuple[Ints, Ints, F64, F64]:
    """Per window, the spans (sorted by start, running max `reach`) meeting it, clipped: (window,
    position in the sorted spans, start, end), windows in order and positions ascending in each."""
    lo = np.searchsorted(reach, t0, side="right")
    hi = np.searchsorted(starts, t1, side="left")
    n = np.maximum(hi - lo, 0)
    win = np.repeat(np.arange(len(t0), dtype=np.int64), n)
    first = np.zeros(len(n), dtype=np.int64)
    np.cumsum(n[:-1], out=first[1:])
    pos = lo[win] + np.arange(len(win), dtype=np.int64) - first[win]
    keep = ends[pos] > t0[win]
    win, pos = win[keep], pos[keep]
    return win, pos, np.maximum(starts[pos], t0[win]), np.minimum(ends[pos], t1[win])


class _Bounds:
    """Every window's elementary segment bounds (np.unique of its points), flattened in window order."""

    def __init__(self, windows: int, win: Ints, pts: F64) -> None:
        order = np.lexsort((pts, win))
        w, v = win[order], pts[order]
        new = np.ones(len(v), dtype=bool)
        new[1:] = (w[1:] != w[:-1]) | (v[1:] != v[:-1])
        self.index = np.empty(len(v), dtype=np.int64)  # each given point's position in the bounds
        self.index[order] = np.cumsum(new) - 1
        self.value, self.win = v[new], w[new]
        self.count = np.bincount(self.win, minlength=windows)
        # Segment g lies between bounds g and g + 1 of the same window.
        self.seg = np.flatnonzero(self.win[1:] == self.win[:-1]) if len(v) else np.zeros(0, dtype=np.int64)
        self.width = self.value[self.seg + 1] - self.value[self.seg]
        self.seg_win = self.win[self.seg]

    def cover(self, start_idx: Ints, end_idx: Ints) -> npt.NDArray[np.bool_]:
        """Which segments the spans (given by their bounds' positions) cover."""
        delta = np.zeros(len(self.value) + 1, dtype=np.int64)
        np.add.at(delta, start_idx, 1)
        np.add.at(delta, end_idx, -1)
        return np.cumsum(delta)[self.seg] > 0

    def sums(self, mask: npt.NDArray[np.bool_], windows: int) -> F64:
        """Per window, the width of its masked segments, summed as width[mask].sum() would."""
        return segment_sum(self.width[mask], np.bincount(self.seg_win[mask], minlength=windows))


Totals = dict[str, float]
PerScheme = dict[str, dict[str, float]]


def classify_windows(spans: RankSpans, t0s: F64, t1s: F64) -> list[tuple[Totals, PerScheme]]:
    """breakdown.classify of each window [t0s[j], t1s[j]] (rank clock)."""
    t0 = np.asarray(t0s, dtype=np.float64)
    t1 = np.asarray(t1s, dtype=np.float64)
    w = len(t0)
    if not w:
        return []
    kinds = ("compute", "comm", "memory", "wait", "calls")
    clipped = {}
    for name in kinds:
        ix = spans.index_of(name)
        clipped[name] = _clip_many(ix.start, ix.reach, ix.end, t0, t1)
    wins = [np.arange(w, dtype=np.int64), np.arange(w, dtype=np.int64)]
    pts = [t0, t1]
    for name in kinds:
        cw, _, s, e = clipped[name]
        wins += [cw, cw]
        pts += [s, e]
    b = _Bounds(w, np.concatenate(wins), np.concatenate(pts))
    at = 2 * w
    idx: dict[str, tuple[Ints, Ints]] = {}
    for name in kinds:
        n = len(clipped[name][0])
        idx[name] = (b.index[at : at + n], b.index[at + n : at + 2 * n])
        at += 2 * n
    comp, comm = b.cover(*idx["compute"]), b.cover(*idx["comm"])
    mem, wait = b.cover(*idx["memory"]), b.cover(*idx["wait"])
    cats = {
        "compute": comp & ~comm,
        "overlapped": comp & comm,
        "wait": ~comp & comm & wait,
        "exposed": ~comp & comm & ~wait,
        "memcpy": ~comp & ~comm & mem,
    }
    totals = {name: b.sums(mask, w) for name, mask in cats.items()}
    used = 0.0 + totals["compute"] + totals["overlapped"] + totals["wait"] + totals["exposed"] + totals["memcpy"]
    left = (t1 - t0) - used
    idle = np.where(left > 0.0, left, 0.0)
    # Owner of each segment: the first call covering it in (start, end, scheme) order.
    cw, cpos, cs, ce = clipped["calls"]
    ix = spans.index_of("calls")
    names = sorted({sc for _, _, sc in spans.calls})
    code_of = {sc: i for i, sc in enumerate(names)}
    codes = np.asarray([code_of[spans.calls[i][2]] for i in ix.order[cpos].tolist()], dtype=np.int64)
    order = np.lexsort((codes, ce, cs, cw))
    c_first, c_last = idx["calls"][0][order], idx["calls"][1][order]
    owner = np.full(len(b.value), len(order), dtype=np.int64)
    n_segs = np.maximum(c_last - c_first, 0)  # a call ending before it starts covers nothing
    if len(order):
        call_of = np.repeat(np.arange(len(order), dtype=np.int64), n_segs)
        off = np.zeros(len(order), dtype=np.int64)
        np.cumsum(n_segs[:-1], out=off[1:])
        covered = c_first[call_of] + np.arange(len(call_of), dtype=np.int64) - off[call_of]
        np.minimum.at(owner, covered, call_of)
    seg_owner = owner[b.seg]
    owner_code = np.append(codes[order], -1)[seg_owner]  # -1: no call covers the segment
    out: list[tuple[Totals, PerScheme]] = [
        (
            {
                "compute": float(totals["compute"][j]),
                "overlapped": float(totals["overlapped"][j]),
                "wait": float(totals["wait"][j]),
                "exposed": float(totals["exposed"][j]),
                "memcpy": float(totals["memcpy"][j]),
                "idle": float(idle[j]),
            },
            {},
        )
        for j in range(w)
    ]
    # The order in which each window names its schemes: first appearance among its sorted calls.
    first_seen: dict[tuple[int, int], int] = {}
    for j, c, q in zip(cw[order].tolist(), codes[order].tolist(), range(len(order)), strict=True):
        first_seen.setdefault((j, c), q)
    for cat in ("overlapped", "wait", "exposed"):
        sel = np.flatnonzero(cats[cat])
        if not len(sel):
            continue
        key_w, key_c = b.seg_win[sel], owner_code[sel]
        o = np.lexsort((key_c, key_w))  # stable: segments stay in window order within a key
        kw, kc = key_w[o], key_c[o]
        brk = np.ones(len(o), dtype=bool)
        brk[1:] = (kw[1:] != kw[:-1]) | (kc[1:] != kc[:-1])
        starts = np.flatnonzero(brk)
        counts = np.diff(np.append(starts, len(o)))
        sums = segment_sum(b.width[sel][o], counts)
        groups: dict[int, list[tuple[int, int, float]]] = {}
        for j, c, us in zip(kw[starts].tolist(), kc[starts].tolist(), sums.tolist(), strict=True):
            if us > 0:
                rank_in = first_seen[(j, c)] if c >= 0 else len(order)
                groups.setdefault(j, []).append((rank_in, c, us))
        for j, items in groups.items():
            per = out[j][1]
            for _, c, us in sorted(items):
                sc = names[c] if c >= 0 else UNATTRIBUTED
                per.setdefault(sc, {"overlapped": 0.0, "wait": 0.0, "exposed": 0.0})[cat] += us
    return out


def memory_busy(spans: RankSpans, t0s: F64, t1s: F64) -> F64:
    """Per window, the time any memory operation runs in it (the union of the clipped memory spans)."""
    t0 = np.asarray(t0s, dtype=np.float64)
    t1 = np.asarray(t1s, dtype=np.float64)
    ix = spans.index_of("memory")
    mw, _, s, e = _clip_many(ix.start, ix.reach, ix.end, t0, t1)
    b = _Bounds(len(t0), np.concatenate([mw, mw]), np.concatenate([s, e]))
    n = len(mw)
    return b.sums(b.cover(b.index[:n], b.index[n:]), len(t0))
