"""Pieces of the columnar grouping (ingest/kineto_columns.py) made without whole-trace temporaries give
what their plain definitions give."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from commlens.ingest import kineto_columns
from commlens.ingest.kineto_columns import (
    _Calls,
    _calls_of_ext,
    _codes,
    _containing,
    _launch_index,
    _padded,
    _segment_first,
    _shape_ids,
)
from commlens.ingest.kineto_model import EPS
from commlens.ingest.kineto_records import NONE


def _first_valid(valid: np.ndarray, bounds: np.ndarray) -> list[int]:
    out = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        hit = np.flatnonzero(valid[a:b])
        out.append(a + int(hit[0]) if len(hit) else -1)
    return out


def test_segment_first_is_the_first_valid_position() -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(0, 40))
        valid = rng.random(n) < rng.random()
        bounds = np.r_[0, np.sort(rng.integers(0, n + 1, int(rng.integers(0, 9)))), n]
        assert _segment_first(valid, bounds).tolist() == _first_valid(valid, bounds)
    assert _segment_first(np.asarray([False, True, True]), np.asarray([0, 1, 1, 3])).tolist() == [-1, -1, 1]


def test_codes_are_numpys_unique_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kineto_columns, "_CHUNK", 7)  # many chunks, values first seen in later ones
    rng = np.random.default_rng(9)
    for n, distinct in ((0, 1), (1, 1), (50, 3), (200, 40), (200, 1000)):
        values = rng.integers(-5, distinct, n) * 1_000_003
        inverse, first = _codes(values)
        _, want_first, want_inverse = np.unique(values, return_index=True, return_inverse=True)
        assert inverse.tolist() == want_inverse.reshape(-1).tolist()
        assert first.tolist() == want_first.tolist()


def test_a_kernel_takes_the_call_of_the_first_member_with_its_external_id() -> None:
    rng = np.random.default_rng(10)
    for _ in range(200):
        sizes = rng.integers(1, 4, int(rng.integers(1, 30)))
        bounds = np.r_[0, np.cumsum(sizes)]
        member = rng.permutation(int(bounds[-1]))  # CPU record indices in member order
        ext = rng.integers(0, 12, len(member)).astype(np.int64)
        ext[rng.random(len(ext)) < 0.2] = NONE
        wanted = rng.integers(0, 15, int(rng.integers(0, 20))).astype(np.int64)  # some no member has
        calls = _Calls(member, bounds, [], [])
        call_of_member = np.repeat(np.arange(len(sizes)), sizes)
        want = []
        for w in wanted.tolist():
            hit = np.flatnonzero(ext[member] == w)
            want.append(int(call_of_member[hit[0]]) if len(hit) else -1)
        assert _calls_of_ext(ext, calls, wanted).tolist() == want


def test_containing_a_chunk_at_a_time_finds_the_same_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(12)
    for _ in range(100):
        starts = np.sort(rng.random(int(rng.integers(0, 30))) * 100)
        ends = starts + rng.random(len(starts)) * 10
        t = rng.random(int(rng.integers(0, 60))) * 110
        whole = _containing(starts, starts, ends, t)
        monkeypatch.setattr(kineto_columns, "_CHUNK", 7)
        chunked = _containing(starts, starts, ends, t)
        monkeypatch.setattr(kineto_columns, "_CHUNK", 1 << 20)
        assert chunked.tolist() == whole.tolist()
        for k, c in enumerate(whole.tolist()):  # found: the call contains t; -1: none of the 4 before it does
            if c >= 0:
                assert starts[c] - EPS <= t[k] <= ends[c] + EPS


class _Launches:
    """What _launch_index reads of a Collector: its launches' correlation ids."""

    def __init__(self, corr: np.ndarray):
        self.launch_cols = self
        self.corr = self
        self._corr = corr

    def __len__(self) -> int:
        return len(self._corr)

    def numpy(self) -> np.ndarray:
        return self._corr


def test_a_kernel_takes_the_last_launch_of_its_correlation_id() -> None:
    rng = np.random.default_rng(11)
    for case in range(300):
        n = int(rng.integers(0, 25))
        rising = case % 2 == 0  # ids rising in file order (no sort), and any order with repeats
        corr = np.cumsum(rng.integers(1, 4, n)) if rising else rng.integers(0, 10, n)
        corr = corr.astype(np.int64)
        kcorr = np.r_[rng.integers(-1, 40 if rising else 12, int(rng.integers(0, 15))), NONE].astype(np.int64)
        last = {c: i for i, c in enumerate(corr.tolist())}  # the reference's dict: the last one listed
        want = [last.get(c, -1) if c != NONE else -1 for c in kcorr.tolist()]
        assert _launch_index(_Launches(corr), kcorr).tolist() == want  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [1 << 20, 7])
def test_shapes_packed_or_not_number_segments_alike(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kineto_columns, "_CHUNK", chunk)
    rng = np.random.default_rng(8)
    for top in (3, 5000):  # codes small enough to pack into one int64, and too large
        sizes_m, sizes_k = rng.integers(1, 4, 50), rng.integers(0, 3, 50)
        bm, bk = np.r_[0, np.cumsum(sizes_m)], np.r_[0, np.cumsum(sizes_k)]
        vm, vk = rng.integers(0, top, bm[-1]), rng.integers(0, top, bk[-1])
        vm[bm[:-1][::5]] = 0  # repeated shapes
        of, first = _shape_ids([(vm, bm), (vk, bk)])
        rows = np.concatenate([_padded(vm, bm, int(sizes_m.max())), _padded(vk, bk, int(sizes_k.max()))], axis=1)
        keys = [tuple(r) for r in rows.tolist()]
        assert all((of[i] == of[j]) == (keys[i] == keys[j]) for i in range(50) for j in range(50))
        assert all(int(first[of[i]]) == keys.index(keys[i]) for i in range(50))  # each shape's first segment
        assert len(first) == len(set(keys))


def test_row_tables_pickle_to_their_own_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parse sent to a worker's caller or held on disk is pickled: each table of rows must carry its
    own rows only (a slice of one big table would carry all of them, once per table)."""
    from conftest import shared_data
    from kineto_synth import write_trace_gz

    from commlens.ingest import kineto
    from commlens.ingest.inputs import iter_inputs
    from commlens.ingest.parse_file import parse_file
    from commlens.ingest.records import RankHint

    trace = tmp_path / "t.json.gz"
    write_trace_gz(shared_data() / "kineto-hta/nccl_parser_config/nccl_data.json.gz", 5000, trace)
    monkeypatch.setattr(kineto, "ROW_BATCH", 1000)
    result = parse_file(next(iter(iter_inputs([trace]))), RankHint()).result
    assert result is not None
    tables = result.event_tables
    assert [t.num_rows for t in tables] == [1000] * 5 and [r["seq"] for r in result.all_events()] == list(range(5000))
    size = len(pickle.dumps(tables, protocol=pickle.HIGHEST_PROTOCOL))
    assert size < 2 * sum(t.nbytes for t in tables)
