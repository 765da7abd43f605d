"""Windows classified a bounded number of spans at a time (segments.CHUNK_SPANS) give, to the bit, what
all windows at once give: the run cut into passes changes memory, not numbers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from commlens.backend.timing import segments
from commlens.backend.timing.breakdown import RankSpans
from commlens.backend.timing.segments import classify_columns, memory_busy


def _spans() -> RankSpans:
    rng = np.random.default_rng(11)

    def rows(n: int, length: float) -> list[tuple[float, float]]:
        s = np.sort(rng.random(n) * 1000)
        return [(float(a), float(a + rng.random() * length)) for a in s]

    calls = [(a, e, sc) for (a, e), sc in zip(rows(90, 30), ["dp", "tp", "unattributed"] * 30, strict=True)]
    return RankSpans.of_rows(rows(300, 8), rows(90, 25), rows(40, 5), rows(60, 10), calls)


def _windows() -> tuple[np.ndarray, np.ndarray]:
    """Steps of 25 µs back to back, one long window over all of them, an empty one, one past the end."""
    t0 = np.r_[np.arange(0.0, 1000.0, 25.0), 0.0, 400.0, 2000.0]
    t1 = np.r_[np.arange(25.0, 1025.0, 25.0), 1000.0, 400.0, 2100.0]
    return t0, t1


def _flat(c: segments.WindowClasses) -> list[object]:
    return [{k: v.tolist() for k, v in c.totals.items()}, c.win.tolist(), c.scheme, *(
        x.tolist() for x in (c.overlapped, c.wait, c.exposed)
    )]  # fmt: skip


def test_passes_give_the_numbers_of_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    spans, (t0, t1) = _spans(), _windows()
    whole, busy = classify_columns(spans, t0, t1), memory_busy(spans, t0, t1)
    assert len(segments._chunks(spans, segments._KINDS, t0, t1)) == 1
    monkeypatch.setattr(segments, "CHUNK_SPANS", 16)
    runs = segments._chunks(spans, segments._KINDS, t0, t1)
    assert len(runs) > 10 and runs[0][0] == 0 and runs[-1][1] == len(t0)
    assert all(a < b for a, b in runs) and all(b == a2 for (_, b), (a2, _) in itertools.pairwise(runs))
    cut = classify_columns(spans, t0, t1)
    assert _flat(cut) == _flat(whole)
    assert memory_busy(spans, t0, t1).tolist() == busy.tolist()
    assert sorted(set(cut.scheme)) == ["dp", "tp", "unattributed"]
    assert cut.totals["idle"][-1] == 100.0 and cut.totals["idle"][-2] == 0.0


def test_rows_in_order_are_not_sorted_again() -> None:
    from commlens.backend.timing.persist import _ascending

    a = np.asarray([0, 0, 0, 1, 1])
    assert _ascending(a, np.asarray([5, 5, 6, 0, 0]), np.asarray([1, 2, 0, 9, 9]))
    assert not _ascending(a, np.asarray([5, 5, 6, 0, 0]), np.asarray([2, 1, 0, 9, 9]))  # seq falls within a source
    assert not _ascending(a, np.asarray([6, 5, 6, 0, 0]), np.asarray([0, 1, 2, 3, 4]))  # source falls within a rank
    assert not _ascending(np.asarray([1, 0]), np.asarray([0, 0]), np.asarray([0, 1]))
    assert _ascending(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def test_spans_given_in_order_index_as_sorted_ones() -> None:
    from commlens.backend.timing.breakdown import _SpanIndex

    rows = np.asarray([[1.0, 4.0], [1.0, 2.0], [3.0, 9.0], [5.0, 6.0]])
    shuffled = rows[[2, 0, 3, 1]]
    a, b = _SpanIndex(rows), _SpanIndex(shuffled)
    assert a.start.tolist() == b.start.tolist() == [1.0, 1.0, 3.0, 5.0]
    assert a.end.tolist() == b.end.tolist() == [4.0, 2.0, 9.0, 6.0]
    assert a.reach.tolist() == b.reach.tolist() == [4.0, 4.0, 9.0, 9.0]
    assert a.order.tolist() == [0, 1, 2, 3] and b.order.tolist() == [1, 3, 0, 2]
    assert _SpanIndex(rows, keep_order=False).order.tolist() == []
    cols = _SpanIndex((shuffled[:, 0].copy(), shuffled[:, 1].copy()))  # as columns: the same index
    assert (cols.start.tolist(), cols.end.tolist(), cols.order.tolist()) == (
        b.start.tolist(),
        b.end.tolist(),
        [1, 3, 0, 2],
    )
    starts = rows[:, 0].copy()
    assert _SpanIndex((starts, rows[:, 1].copy())).start is starts  # in order already: not copied
