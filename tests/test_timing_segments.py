"""Column-wise classification of many windows (backend/timing/segments.py): the same numbers, to the bit,
as one window at a time and as numpy's own sums."""

from __future__ import annotations

import itertools

import numpy as np

from commlens.backend.timing.breakdown import RankSpans, classify
from commlens.backend.timing.segments import classify_windows, memory_busy, segment_sum, sequential_sums, sparse_sum


def test_segment_sum_adds_in_numpys_order() -> None:
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 400, 300)
    counts[:20] = np.arange(20)
    values = rng.random(int(counts.sum())) * rng.choice([1e-3, 1.0, 1e3, 1e7], int(counts.sum()))
    got = segment_sum(values, counts)
    at = np.concatenate([[0], np.cumsum(counts)])
    want = [values[a:b].sum() for a, b in itertools.pairwise(at)]
    assert got.tolist() == [float(x) for x in want]


def test_sequential_sums_add_as_python_does() -> None:
    """Runs short and long (the straggler and rank sums that were `+=` loops), 1-D and per column."""
    rng = np.random.default_rng(11)
    counts = rng.integers(0, 90, 200)
    counts[:3] = [0, 1, 500]
    values = rng.random(int(counts.sum())) * rng.choice([1e-3, 1.0, 1e3, 1e9], int(counts.sum()))
    at = np.concatenate([[0], np.cumsum(counts)]).tolist()
    want = [sum(values[a:b].tolist()) for a, b in itertools.pairwise(at)]
    assert sequential_sums(values, counts).tolist() == want
    assert want != [float(values[a:b].sum()) for a, b in itertools.pairwise(at)]  # pairwise order differs
    table = np.stack([values, values[::-1]], axis=1)
    cols = sequential_sums(table, counts)
    assert cols[:, 1].tolist() == [sum(table[a:b, 1].tolist()) for a, b in itertools.pairwise(at)]


def test_sparse_sum_is_the_sum_of_the_whole_array() -> None:
    rng = np.random.default_rng(5)
    for n in (5, 9, 100, 129, 300, 1000, 20_000, 100_000):
        for _ in range(30):
            lo = int(rng.integers(0, n))
            vals = rng.random(int(rng.integers(0, min(n - lo, 40) + 1))) * 1e3
            x = np.zeros(n)
            x[lo : lo + len(vals)] = vals
            assert sparse_sum(n, lo, vals.tolist()) == float(x.sum())


def _reference(spans: RankSpans, t0: float, t1: float) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The rule as breakdown.classify states it, one window with plain clipping (the code it replaced)."""

    def clip(rows: np.ndarray) -> np.ndarray:
        return np.asarray([(max(s, t0), min(e, t1)) for s, e in rows.tolist() if e > t0 and s < t1]).reshape(-1, 2)

    def cover(bounds: np.ndarray, arr: np.ndarray) -> np.ndarray:
        delta = np.zeros(len(bounds) + 1, dtype=np.int64)
        np.add.at(delta, np.searchsorted(bounds, arr[:, 0]), 1)
        np.add.at(delta, np.searchsorted(bounds, arr[:, 1]), -1)
        return np.cumsum(delta)[: len(bounds) - 1] > 0

    parts = {n: clip(spans.spans(n)) for n in ("compute", "comm", "memory", "wait")}
    calls = sorted((max(s, t0), min(e, t1), sc) for s, e, sc in spans.calls if e > t0 and s < t1)
    pts = np.asarray([x for s, e, _ in calls for x in (s, e)], dtype=np.float64)
    bounds = np.unique(np.concatenate([np.asarray([t0, t1]), *(p.ravel() for p in parts.values()), pts]))
    width = np.diff(bounds)
    comp, comm, mem, wait = (cover(bounds, parts[n]) for n in ("compute", "comm", "memory", "wait"))
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
    for s, e, sc in calls:
        if sc not in names:
            names.append(sc)
        seg = owner[int(np.searchsorted(bounds, s)) : int(np.searchsorted(bounds, e))]
        seg[seg < 0] = names.index(sc)
    per: dict[str, dict[str, float]] = {}
    for cat in ("overlapped", "wait", "exposed"):
        for code, sc in [*enumerate(names), (-1, "unattributed")]:
            us = float(width[cats[cat] & (owner == code)].sum())
            if us > 0:
                per.setdefault(sc, {"overlapped": 0.0, "wait": 0.0, "exposed": 0.0})[cat] += us
    return totals, per


def _spans() -> RankSpans:
    rng = np.random.default_rng(3)

    def rows(n: int, length: float) -> list[tuple[float, float]]:
        s = np.sort(rng.random(n) * 1000)
        return [(float(a), float(a + rng.random() * length)) for a in s]

    calls = [(a, e, sc) for (a, e), sc in zip(rows(60, 30), ["dp", "tp", "unattributed"] * 20, strict=True)]
    calls.append((500.0, 400.0, "dp"))  # ends before it starts: covers nothing
    return RankSpans.of_rows(rows(200, 8), rows(60, 25), rows(30, 5), rows(40, 10), calls)


def test_many_windows_equal_one_at_a_time() -> None:
    spans = _spans()
    t0 = np.asarray([0.0, 10.5, 100.0, 333.3, 500.0, 999.0, 250.0, 1200.0])
    t1 = np.asarray([50.0, 10.5, 400.0, 600.0, 700.0, 1100.0, 260.0, 1300.0])
    many = classify_windows(spans, t0, t1)
    one = [classify_windows(spans, t0[j : j + 1], t1[j : j + 1])[0] for j in range(len(t0))]
    assert many == one == [_reference(spans, a, b) for a, b in zip(t0.tolist(), t1.tolist(), strict=True)]
    assert many[2] == classify(spans, 100.0, 400.0)
    for (totals, per), a, b in zip(many, t0, t1, strict=True):
        assert abs(sum(totals.values()) - max(0.0, b - a)) < 1e-6
        for parts in per.values():
            assert set(parts) == {"overlapped", "wait", "exposed"}
    assert many[7][0]["idle"] == 100.0 and many[7][1] == {}
    busy = memory_busy(spans, t0, t1)
    assert busy.tolist() == [float(memory_busy(spans, t0[j : j + 1], t1[j : j + 1])[0]) for j in range(len(t0))]
