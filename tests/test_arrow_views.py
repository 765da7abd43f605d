"""Arrow tables lent to DuckDB statements (ingest/arrow_views.py): a statement that fails inside a transaction is
the error raised, not the aborted transaction's refusal to unregister the table after it, which used to hide it
("Current transaction is aborted" for a 100 M-call store's out-of-memory error, a constraint or a conversion)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from commlens import store
from commlens.ingest.arrow_views import all_registered, registered
from commlens.store import writer


def _views(con: duckdb.DuckDBPyConnection) -> list[tuple]:
    return con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1").fetchall()


def test_the_failed_statement_is_the_error_and_the_rollback_drops_the_name() -> None:
    con = duckdb.connect()
    con.execute("CREATE TABLE t (x INTEGER)")
    con.execute("BEGIN")
    with pytest.raises(duckdb.ConversionException), registered(con, pa.table({"x": ["not a number"]})) as name:
        assert _views(con) == [(name,)]
        con.execute(f"INSERT INTO t SELECT CAST(x AS INTEGER) FROM {name}")
    con.execute("ROLLBACK")
    assert _views(con) == []


def test_every_table_of_a_block_is_lent_and_taken_back() -> None:
    con = duckdb.connect()
    with all_registered(con, {"_a": pa.table({"x": [1, 2]}), "_b": pa.table({"x": [2, 3]})}):
        assert con.execute("SELECT count(*) FROM _a JOIN _b USING (x)").fetchall() == [(1,)]
    assert _views(con) == []
    con.execute("BEGIN")
    with pytest.raises(duckdb.BinderException), all_registered(con, {"_a": pa.table({"x": [1]})}):
        con.execute("SELECT y FROM _a")
    con.execute("ROLLBACK")
    assert _views(con) == []


def test_a_store_insert_that_breaks_a_constraint_says_so(tmp_path: Path) -> None:
    """The writer's insert of a file's calls, in the file's transaction: a call without its seq (NOT NULL)."""
    con = store.connect(tmp_path / "s.duckdb")
    try:
        con.execute("BEGIN")
        rows = pa.table({"seq": pa.array([1, None], pa.int64()), "op": ["all_reduce", "all_reduce"]})
        with pytest.raises(duckdb.ConstraintException, match=r"comm_events\.seq"):
            writer._insert_table(con, "comm_events", 1, 1, rows)
        con.execute("ROLLBACK")
        assert con.execute("SELECT count(*) FROM comm_events").fetchone() == (0,)
    finally:
        con.close()
