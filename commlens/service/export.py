"""A run's rows of the public `comms` view, filtered, as Arrow batches: what an export streams."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import duckdb
import pyarrow as pa

from commlens.backend.iterations import run_id_of

COMMS_COLUMNS = (
    "run",
    "rank",
    "op",
    "dtype",
    "msg_bytes",
    "elems_in",
    "elems_out",
    "group_size",
    "group_key",
    "scheme",
    "peer",
    "step",
    "ts_us",
    "dur_us",
    "source_kind",
    "file",
)
FILTERS = ("scheme", "op", "dtype", "rank", "step")  # comms columns an export filters on by equality


def comms_query(run: str, filters: dict[str, Any]) -> tuple[str, list[Any]]:
    """SQL over the comms view; filter columns are fixed names (FILTERS), values are parameters."""
    conditions, params = ["run = ?"], [run]
    for column in FILTERS:
        value = filters.get(column)
        if value is not None:
            conditions.append(f"{column} = ?")
            params.append(value)
    cols = ", ".join(COMMS_COLUMNS)
    return f"SELECT {cols} FROM comms WHERE {' AND '.join(conditions)} ORDER BY file, rank, ts_us NULLS LAST", params


def check_run(con: duckdb.DuckDBPyConnection, run: str) -> None:
    """UnknownRunError before a stream starts."""
    run_id_of(con, run)


def comms_batches(
    con: duckdb.DuckDBPyConnection, run: str, filters: dict[str, Any], rows: int, json_lines: bool = False
) -> Iterator[pa.RecordBatch]:
    """The rows in batches of at most `rows`; `json_lines`: one column `line`, each row as a JSON object."""
    sql, params = comms_query(run, filters)
    if json_lines:
        sql = f"SELECT to_json(c)::VARCHAR AS line FROM ({sql}) c"
    yield from con.sql(sql, params=params).to_arrow_reader(rows)


def comms_schema(con: duckdb.DuckDBPyConnection, run: str, filters: dict[str, Any]) -> pa.Schema:
    """The Arrow schema of the rows (for an empty file with the view's columns)."""
    sql, params = comms_query(run, filters)
    return con.sql(f"SELECT * FROM ({sql}) LIMIT 0", params=params).to_arrow_table().schema
