"""The store writer inserts a big table of rows in slices of INSERT_ROWS: every row lands once, in order,
cast to the declared types, and a bad value in a late slice still rolls the whole file back."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from commlens import store
from commlens.ingest.records import ParseResult
from commlens.store import writer

ROWS = 23  # three slices of 10: two full, one of 3


def _events(n: int, first: int = 0) -> pa.Table:
    """Rows whose every value is known: seq, a dictionary-encoded op, an int64 step (declared int32:
    cast), a float time."""
    seq = list(range(first, first + n))
    return pa.table(
        {
            "rank": pa.array([3] * n, pa.int32()),
            "seq": pa.array(seq, pa.int64()),
            "op": pa.DictionaryArray.from_arrays(
                pa.array([s % 2 for s in seq], pa.int8()), ["all_reduce", "broadcast"]
            ),
            "step": pa.array([s // 4 for s in seq], pa.int64()),
            "ts_us": pa.array([s * 1.5 for s in seq], pa.float64()),
        }
    )


@pytest.fixture
def con(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> duckdb.DuckDBPyConnection:
    monkeypatch.setattr(writer, "INSERT_ROWS", 10)
    c = store.connect(tmp_path / "w.duckdb")
    yield c
    c.close()


def test_rows_inserted_in_slices_are_the_table(con: duckdb.DuckDBPyConnection) -> None:
    run_id = store.ensure_run(con, "r")
    result = ParseResult(kind="kineto", rank=3, event_tables=[_events(15), _events(ROWS - 15, 15)])
    source = store.write_result(con, run_id, "f.json", "sha", 1, result)
    rows = con.execute(
        "SELECT rank, seq, op, step, ts_us FROM comm_events WHERE source_id = ? ORDER BY rowid", [source]
    ).fetchall()
    assert rows == [(3, s, ["all_reduce", "broadcast"][s % 2], s // 4, s * 1.5) for s in range(ROWS)]
    assert con.execute("SELECT typeof(step) FROM comm_events LIMIT 1").fetchone() == ("INTEGER",)


def test_a_bad_value_in_the_last_slice_rolls_the_file_back(con: duckdb.DuckDBPyConnection) -> None:
    run_id = store.ensure_run(con, "r")
    bad = _events(ROWS)
    step = bad["step"].to_pylist()
    step[-1] = 2**40  # past the declared INTEGER: the cast of the third slice fails
    bad = bad.set_column(bad.schema.get_field_index("step"), "step", pa.array(step, pa.int64()))
    with pytest.raises(pa.ArrowInvalid):
        store.write_result(con, run_id, "f.json", "sha", 1, ParseResult(kind="kineto", rank=3, event_tables=[bad]))
    assert con.execute("SELECT count(*) FROM comm_events").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM sources").fetchone() == (0,)
