"""Many windows of one rank classified at once (breakdown.classify's rule) with column operations.

A run of 10M calls has over a million (rank, step) windows; numpy's per-call overhead on each window was
most of the analysis. Here every window's clipped spans, elementary segments and coverage are computed
over flat arrays (window id + value), and per-window sums use `segment_sum`, which adds in numpy's own
pairwise order, so every number is bit-for-bit the one `ndarray.sum()` gives on the window alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
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
    """What breakdown.RankSpans offers: each call's scheme (a code into the sorted `scheme_names`) and
    each kind's sorted spans (compute, comm, memory, wait, calls)."""

    @property
    def call_scheme(self) -> Ints: ...
    @property
    def scheme_names(self) -> Sequence[str]: ...
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


_LONG = 64


def sequential_sums(values: npt.NDArray[np.float64], counts: Ints) -> npt.NDArray[np.float64]:
    """Sum of each consecutive run of `counts[j]` values (rows, for 2-D values) added left to right from
    0.0, as Python's `sum` or a `+=` loop adds them: short runs position by position across all runs,
    long ones by np.cumsum (accumulation is sequential)."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    out = np.zeros((len(counts), *values.shape[1:]), dtype=np.float64)
    sel = np.flatnonzero((counts > 0) & (counts <= _LONG))
    for p in range(int(counts[sel].max()) if len(sel) else 0):
        sel = sel[counts[sel] > p]
        out[sel] += values[starts[sel] + p]
    for j in np.flatnonzero(counts > _LONG).tolist():
        out[j] = np.cumsum(values[starts[j] : starts[j] + counts[j]], axis=0)[-1]
    return out


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


@dataclass
class WindowClasses:
    """breakdown.classify of many windows as columns: `totals` per category (one value per window), and
    one row per (window, scheme) with communication time, windows ascending, schemes by name."""

    totals: dict[str, F64]
    win: Ints
    scheme: list[str]
    overlapped: F64
    wait: F64
    exposed: F64

    def as_dicts(self) -> list[tuple[Totals, PerScheme]]:
        names = list(self.totals)
        cols = [self.totals[n].tolist() for n in names]
        out: list[tuple[Totals, PerScheme]] = [
            (dict(zip(names, vals, strict=True)), {}) for vals in zip(*cols, strict=True)
        ]
        for j, sc, o, w, e in zip(
            self.win.tolist(),
            self.scheme,
            self.overlapped.tolist(),
            self.wait.tolist(),
            self.exposed.tolist(),
            strict=True,
        ):
            out[j][1][sc] = {"overlapped": o, "wait": w, "exposed": e}
        return out


def classify_windows(spans: RankSpans, t0s: F64, t1s: F64) -> list[tuple[Totals, PerScheme]]:
    """breakdown.classify of each window [t0s[j], t1s[j]] (rank clock)."""
    return classify_columns(spans, t0s, t1s).as_dicts()


_SCHEME_CATS = ("overlapped", "wait", "exposed")


_KINDS = ("compute", "comm", "memory", "wait", "calls")
# Spans clipped into the windows of one pass. A pass holds about 0.3 KB a span in temporaries: all of a
# 1M-call rank's windows at once took 330 MB above the analysis' input; a pass of this many, ~20 MB.
CHUNK_SPANS = 1 << 16


def _chunks(spans: RankSpans, kinds: Sequence[str], t0: F64, t1: F64) -> list[tuple[int, int]]:
    """The windows cut into consecutive runs [a, b) meeting about CHUNK_SPANS spans each (a window
    meeting more is a run of its own). Windows are classified independently, so runs give the same
    numbers as all windows at once."""
    load = np.ones(len(t0), dtype=np.int64)
    for name in kinds:
        ix = spans.index_of(name)
        lo = np.searchsorted(ix.reach, t0, side="right")
        load += np.maximum(np.searchsorted(ix.start, t1, side="left") - lo, 0)
    total = np.cumsum(load)
    cuts = np.unique(np.searchsorted(total, np.arange(CHUNK_SPANS, int(total[-1]), CHUNK_SPANS), side="right"))
    edges = [0, *(int(c) for c in cuts if 0 < c < len(t0)), len(t0)]
    return list(itertools.pairwise(edges))


def classify_columns(spans: RankSpans, t0s: F64, t1s: F64) -> WindowClasses:
    """breakdown.classify of each window [t0s[j], t1s[j]] (rank clock), as columns, CHUNK_SPANS spans at
    a time."""
    t0 = np.asarray(t0s, dtype=np.float64)
    t1 = np.asarray(t1s, dtype=np.float64)
    if not len(t0):
        return _classify(spans, t0, t1)
    parts = [_classify(spans, t0[a:b], t1[a:b]) for a, b in _chunks(spans, _KINDS, t0, t1)]
    if len(parts) == 1:
        return parts[0]
    offsets = np.cumsum([0] + [len(p.totals["idle"]) for p in parts[:-1]])
    return WindowClasses(
        {c: np.concatenate([p.totals[c] for p in parts]) for c in parts[0].totals},
        np.concatenate([p.win + off for p, off in zip(parts, offsets.tolist(), strict=True)]),
        [sc for p in parts for sc in p.scheme],
        np.concatenate([p.overlapped for p in parts]),
        np.concatenate([p.wait for p in parts]),
        np.concatenate([p.exposed for p in parts]),
    )


def _classify(spans: RankSpans, t0: F64, t1: F64) -> WindowClasses:
    """classify_columns of one run of windows."""
    w = len(t0)
    if not w:
        zero = np.zeros(0, dtype=np.float64)
        names = ("compute", "overlapped", "wait", "exposed", "memcpy", "idle")
        return WindowClasses(dict.fromkeys(names, zero), np.zeros(0, dtype=np.int64), [], zero, zero, zero)
    kinds = _KINDS
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
    totals["idle"] = np.where(left > 0.0, left, 0.0)
    # Owner of each segment: the first call covering it in (start, end, scheme) order.
    cw, cpos, cs, ce = clipped["calls"]
    ix = spans.index_of("calls")
    codes = np.asarray(spans.call_scheme, dtype=np.int64)[ix.order[cpos]]
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
    # Scheme names, sorted; segments no call covers count as UNATTRIBUTED, after the calls of a scheme
    # of that name (a group without a scheme), so their sum adds in that order.
    given = list(spans.scheme_names)
    all_names = sorted({*given, UNATTRIBUTED})
    name_of = np.asarray([all_names.index(n) for n in given] + [all_names.index(UNATTRIBUTED)], dtype=np.int64)
    parts: list[tuple[Ints, Ints, Ints, npt.NDArray[np.bool_], F64]] = []
    for c, cat in enumerate(_SCHEME_CATS):
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
        pos = sums > 0
        pw, pc = kw[starts][pos], kc[starts][pos]
        parts.append((pw, name_of[pc], np.full(len(pw), c, dtype=np.int64), pc < 0, sums[pos]))
    if not parts:
        zero = np.zeros(0, dtype=np.float64)
        return WindowClasses(totals, np.zeros(0, dtype=np.int64), [], zero, zero, zero)
    pw, pn, pcat, pneg, pus = (np.concatenate(x) for x in zip(*parts, strict=True))
    o = np.lexsort((pneg, pcat, pn, pw))
    pw, pn, pcat, pus = pw[o], pn[o], pcat[o], pus[o]
    same = np.r_[False, (pw[1:] == pw[:-1]) & (pn[1:] == pn[:-1]) & (pcat[1:] == pcat[:-1])]
    # at most two values share a (window, name, category): a scheme named UNATTRIBUTED and no call
    val = pus.copy()
    val[np.flatnonzero(same) - 1] += pus[same]
    keep = ~same
    pw, pn, pcat, val = pw[keep], pn[keep], pcat[keep], val[keep]
    row_new = np.r_[True, (pw[1:] != pw[:-1]) | (pn[1:] != pn[:-1])]
    row = np.cumsum(row_new) - 1
    table = np.zeros((int(row_new.sum()), 3), dtype=np.float64)
    table[row, pcat] = val
    return WindowClasses(
        totals,
        pw[row_new],
        [all_names[i] for i in pn[row_new].tolist()],
        table[:, 0].copy(),
        table[:, 1].copy(),
        table[:, 2].copy(),
    )


def memory_busy(spans: RankSpans, t0s: F64, t1s: F64) -> F64:
    """Per window, the time any memory operation runs in it (the union of the clipped memory spans)."""
    t0 = np.asarray(t0s, dtype=np.float64)
    t1 = np.asarray(t1s, dtype=np.float64)
    if not len(t0):
        return np.zeros(0, dtype=np.float64)
    ix = spans.index_of("memory")
    out = []
    for a, z in _chunks(spans, ("memory",), t0, t1):
        mw, _, s, e = _clip_many(ix.start, ix.reach, ix.end, t0[a:z], t1[a:z])
        b = _Bounds(z - a, np.concatenate([mw, mw]), np.concatenate([s, e]))
        n = len(mw)
        out.append(b.sums(b.cover(b.index[:n], b.index[n:]), z - a))
    return np.concatenate(out)
