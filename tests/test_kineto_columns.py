"""The columnar grouping (kineto_columns) gives what the reference path (build_calls + call_row) gives,
row for row and table for table, on every real trace of the shared data and on a synthetic long one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import shared_data
from kineto_synth import EVENTS_PER_CALL, STEP_CALLS, write_trace_gz
from parse_compare import assert_same_parse

from commlens.ingest import kineto, kineto_columns
from commlens.ingest.inputs import InputFile, iter_inputs
from commlens.ingest.parse_file import parse_file
from commlens.ingest.records import ParseResult, RankHint

RESNET = "kineto-hta/nccl_parser_config/nccl_data.json.gz"
SYNTH_CALLS = 50_000  # 200,050 trace events


def _inputs() -> list[InputFile]:
    data = shared_data()
    paths = [*sorted(data.glob("kineto-hta/**/*.json.gz")), data / "kineto-param/dlrm_kineto.tar.gz"]
    return list(iter_inputs(paths))


def _parse(item: InputFile, monkeypatch: pytest.MonkeyPatch, columnar: bool) -> tuple[ParseResult, bool]:
    """The parse by one path, and whether the columnar path made the rows."""
    took: list[bool] = []

    def spy(*args: Any) -> Any:
        out = kineto_columns.columnar_rows(*args)
        took.append(out is not None)
        return out

    monkeypatch.setattr(kineto, "COLUMNAR", columnar)
    monkeypatch.setattr(kineto, "columnar_rows", spy)
    parsed = parse_file(item, RankHint())
    assert parsed.result is not None, parsed.error
    return parsed.result, bool(took and took[0])


def _same(a: ParseResult, b: ParseResult) -> None:
    assert (len(a.event_tables), len(a.events)) == (len(b.event_tables), len(b.events))
    assert_same_parse(a, b)


def test_real_traces_give_the_reference_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    covered = []
    for item in _inputs():
        reference, took = _parse(item, monkeypatch, columnar=False)
        assert not took
        columnar, took = _parse(item, monkeypatch, columnar=True)
        _same(columnar, reference)
        covered.append((Path(item.name.split("!")[-1]).name, took, columnar.n_events))
    took_names = {name for name, took, _ in covered if took}
    # every real trace's layout is one the columnar path reads (no gloo worker threads, no labels)
    assert len(covered) == 15 and len(took_names) == 15, covered
    assert sum(n for _, _, n in covered) > 2000


def test_a_long_synthetic_trace_gives_the_reference_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "allreduce.json.gz"
    written = write_trace_gz(shared_data() / RESNET, SYNTH_CALLS, path)
    assert written == SYNTH_CALLS * EVENTS_PER_CALL + SYNTH_CALLS // STEP_CALLS
    item = next(iter_inputs([path]))
    reference, _ = _parse(item, monkeypatch, columnar=False)
    columnar, took = _parse(item, monkeypatch, columnar=True)
    assert took
    _same(columnar, reference)
    rows = columnar.all_events()
    assert len(rows) == SYNTH_CALLS and [r["seq"] for r in rows] == list(range(SYNTH_CALLS))
    assert {r["step"] for r in rows} == set(range(SYNTH_CALLS // STEP_CALLS))
    assert {(r["op"], r["msg_bytes"], r["dur_us"], r["dur_source"]) for r in rows} == {
        ("all_reduce", 4096, 15.0, "kernel")
    }
