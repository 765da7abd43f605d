"""Exports: a run's rows of the public `comms` view, filtered, as Arrow batches (what the API streams), and
the whole store (or one run) as a hive-partitioned Parquet dataset that other engines query with the same SQL."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from commlens.backend.iterations import UnknownRunError, run_id_of
from commlens.contract.analysis import UNATTRIBUTED
from commlens.ingest.parse_file import first_line
from commlens.service.errors import InvalidError, NotFoundError
from commlens.service.runs import resolve_alias

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
        if column == "scheme" and value == UNATTRIBUTED:  # the calls without a scheme, as /calls selects them
            conditions.append("scheme IS NULL")
        elif value is not None:
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


# ------------------------------------------------------------------------ the store as a Parquet dataset

SECRET_COLUMN = "%token%"  # tables holding tokens (even hashed) never leave the store
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # a NULL partition value, as DuckDB, Hive and Spark spell it


@dataclass(frozen=True)
class ExportedRelation:
    name: str
    rows: int
    partitions: tuple[str, ...]  # hive partition columns: ("run", "rank"), ("run",) or none


def export_parquet(con: duckdb.DuckDBPyConnection, out: Path, run: str | None = None) -> list[ExportedRelation]:
    """Every table and view of the store (or only `run`'s rows) as Parquet under `out`, hive-partitioned:
    `<name>/run=<run name>/rank=<r>/part-0.parquet` where the relation has a rank, `<name>/run=<run name>/...`
    where it has a run, `<name>/part-0.parquet` otherwise. Relations keyed by `run_id` gain the run's name as
    `run`. Tables with token columns (users) are left out. A failure removes what the export wrote (and the
    folders it made), so no partial dataset is left to be read as a whole one."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidError(f"{out}: exists and is not an empty folder; give a new folder for the export", "export")
    if run is not None:
        run = resolve_alias(con, run) or run  # a former name exports the run it names now, as the API reads it
        try:
            check_run(con, run)
        except UnknownRunError:
            raise NotFoundError(f"no run named {run!r} in the store", "run") from None
    columns: dict[str, dict[str, str]] = {}
    for name, column, typ in con.execute(
        "SELECT table_name, column_name, data_type FROM duckdb_columns() WHERE database_name = current_database() "
        "AND schema_name = 'main' ORDER BY table_name, column_index"
    ).fetchall():
        columns.setdefault(str(name), {})[str(column)] = str(typ)
    secret = {
        str(r[0])
        for r in con.execute(
            "SELECT DISTINCT table_name FROM duckdb_columns() WHERE database_name = current_database() "
            "AND column_name LIKE ?",
            [SECRET_COLUMN],
        ).fetchall()
    }
    made = _first_missing(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise InvalidError(f"{out}: cannot write there ({exc.strerror or exc})", "export") from None
    started: list[Path] = []
    written = []
    try:
        for name, cols in columns.items():
            if name not in secret:
                started.append(out / name)
                written.append(_export_one(con, out, name, cols, run))
    except BaseException as exc:  # interrupted too: what this export wrote goes, and only that
        for path in [made] if made is not None else started:
            shutil.rmtree(path, ignore_errors=True)
        if not isinstance(exc, OSError | duckdb.Error):
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
        raise InvalidError(f"{out}: the export failed ({reason}); nothing was written", "export") from None
    return written


def _first_missing(path: Path) -> Path | None:
    """The outermost folder that making `path` creates (None: it exists), removed whole if the export fails."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def _export_one(
    con: duckdb.DuckDBPyConnection, out: Path, name: str, cols: dict[str, str], run: str | None
) -> ExportedRelation:
    params: list[Any] = []
    # Parquet has no 128-bit integer: HUGEINT (sums of bytes) goes as DECIMAL(38,0), exact, not as DOUBLE
    listed = ", ".join(
        f't."{c}"' if typ != "HUGEINT" else f't."{c}"::DECIMAL(38, 0) AS "{c}"' for c, typ in cols.items()
    )
    if "run_id" in cols and "run" not in cols:
        sql = f'SELECT {listed}, r.name AS run FROM "{name}" t LEFT JOIN runs r ON r.run_id = t.run_id'
        partitions: tuple[str, ...] = ("run", "rank") if "rank" in cols else ("run",)
        where = "r.name = ?"
    elif "run" in cols:
        sql = f'SELECT {listed} FROM "{name}" t'
        partitions = ("run", "rank") if "rank" in cols else ("run",)
        where = "run = ?"
    else:
        sql, partitions, where = f'SELECT {listed} FROM "{name}" t', (), ""
    if run is not None and where:
        sql, params = f"{sql} WHERE {where}", [run]
    count = con.execute(f"SELECT count(*) FROM ({sql})", params).fetchone()
    rows = int(count[0]) if count else 0
    target = out / name
    if rows and partitions:
        con.execute(
            f"COPY ({sql}) TO '{_literal(target)}' (FORMAT parquet, PARTITION_BY ({', '.join(partitions)}), "
            "FILENAME_PATTERN 'part-{i}')",
            params,
        )
    elif partitions:  # no rows: the columns in a folder of NULL partitions, which readers naming them find
        folder = target.joinpath(*(f"{p}={HIVE_NULL}" for p in partitions))
        folder.mkdir(parents=True)
        empty = f"SELECT * EXCLUDE ({', '.join(partitions)}) FROM ({sql})"
        con.execute(f"COPY ({empty}) TO '{_literal(folder / 'part-0.parquet')}' (FORMAT parquet)", params)
    else:
        target.mkdir()
        con.execute(f"COPY ({sql}) TO '{_literal(target / 'part-0.parquet')}' (FORMAT parquet)", params)
    return ExportedRelation(name, rows, partitions)


def _literal(path: Path) -> str:
    return str(path).replace("'", "''")
