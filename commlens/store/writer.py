"""The only code that writes trace rows: runs, sources, and one parsed file's rows, all or none."""

from __future__ import annotations

import json
from typing import Any

import duckdb
import pyarrow as pa

from commlens.ingest.arrow_views import registered
from commlens.ingest.records import TABLE_COLUMNS, ParseResult, rows_table

from .errors import StoreError
from .tables import AGG_TABLES, TRACE_TABLES
from .transaction import transaction

# --------------------------------------------------------------------------------------- runs


def get_run_id(con: duckdb.DuckDBPyConnection, name: str) -> int | None:
    rows = con.execute("SELECT run_id FROM runs WHERE name = ?", [name]).fetchall()
    return int(rows[0][0]) if rows else None


def ensure_run(
    con: duckdb.DuckDBPyConnection,
    name: str,
    description: str | None = None,
    tags: list[str] | None = None,
    owner_id: int | None = None,
) -> int:
    """The run's id, made now if missing (owned by `owner_id`, a user id, when given)."""
    run_id = get_run_id(con, name)
    if run_id is not None:
        return run_id
    check_new_run_name(name)
    renamed = con.execute(
        "SELECT r.name FROM run_aliases a JOIN runs r USING (run_id) WHERE a.alias = ?", [name]
    ).fetchall()
    if renamed:  # links holding the old name lead to the renamed run; a new run must not take them
        raise StoreError(f"{name!r} is a former name of run {renamed[0][0]!r}; use that name or pick another")
    return _one(
        con.execute(
            "INSERT INTO runs (name, description, tags, owner_id) VALUES (?, ?, ?, ?) RETURNING run_id",
            [name, description, tags or [], owner_id],
        )
    )


def check_new_run_name(name: str) -> None:
    """StoreError for a name no new run may take: the API and the dashboard address a run by its name in their
    paths (/api/runs/{name}), where a '/' cannot be, an empty segment is no name, '.' and '..' are resolved
    away, and whitespace at either end does not survive being typed or copied (a run of such a name would be
    stored and unreachable)."""
    if "/" in name:
        raise StoreError(
            f"run name {name!r} holds a '/', which the API's and the dashboard's paths cannot carry; pick another name"
        )
    if not name.strip():
        raise StoreError(
            f"run name {name!r} is empty or only whitespace, which the API's and the dashboard's paths cannot "
            "address; pick another name"
        )
    if name.strip() in (".", ".."):
        raise StoreError(
            f"run name {name!r} is a relative path segment, which URLs resolve away so the API's and the "
            "dashboard's paths cannot reach it; pick another name"
        )
    if name != name.strip():
        raise StoreError(
            f"run name {name!r} begins or ends with whitespace, which is lost when the name is typed or copied "
            f"into the API's and the dashboard's paths; pick another name (such as {name.strip()!r})"
        )


def set_run_config(con: duckdb.DuckDBPyConnection, run_id: int, config: dict[str, Any]) -> None:
    con.execute(
        "UPDATE runs SET config = ?, strategy = ?, world_size = ?, updated_at = current_timestamp WHERE run_id = ?",
        [json.dumps(config), config.get("strategy"), config.get("world_size"), run_id],
    )


# ------------------------------------------------------------------------------------ sources


def find_source(con: duckdb.DuckDBPyConnection, run_id: int, sha256: str) -> tuple[int, str] | None:
    """An already ingested (status ok) source with these bytes in this run."""
    row = con.execute(
        "SELECT source_id, path FROM sources WHERE run_id = ? AND sha256 = ? AND status = 'ok' LIMIT 1",
        [run_id, sha256],
    ).fetchone()
    return (row[0], row[1]) if row else None


def record_failure(
    con: duckdb.DuckDBPyConnection, run_id: int, path: str, kind: str, sha256: str, size: int, error: str
) -> int:
    # The same bytes failing again replace their earlier record: re-ingesting stays a no-op for the store.
    con.execute(
        "DELETE FROM sources WHERE run_id = ? AND path = ? AND sha256 = ? AND status = 'failed'", [run_id, path, sha256]
    )
    return _one(
        con.execute(
            "INSERT INTO sources (run_id, path, kind, sha256, size_bytes, status, error) "
            "VALUES (?, ?, ?, ?, ?, 'failed', ?) RETURNING source_id",
            [run_id, path, kind, sha256, size, error],
        )
    )


def _insert_rows(
    con: duckdb.DuckDBPyConnection, table: str, run_id: int, source_id: int, rows: list[dict[str, Any]]
) -> None:
    if rows:  # keys not in the table are ignored; columns no row has are left to their default (NULL)
        _insert_table(con, table, run_id, source_id, rows_table(table, rows))


# DuckDB's row group (rows): an INSERT of this many rows fills one and it goes to the file. One INSERT of a
# whole 5M-row table held 710 MB more at its peak; in slices of a row group, 210 MB (bench/README.md).
INSERT_ROWS = 122_880


def _same_schema_batches(tables: list[pa.Table]) -> list[pa.Table]:
    """Consecutive tables of one schema as one (chunks are not copied), inserted in INSERT_ROWS slices."""
    batches: list[list[pa.Table]] = []
    for t in tables:
        if batches and batches[-1][0].schema == t.schema:
            batches[-1].append(t)
        else:
            batches.append([t])
    return [pa.concat_tables(b) if len(b) > 1 else b[0] for b in batches]


def _insert_table(con: duckdb.DuckDBPyConnection, table: str, run_id: int, source_id: int, arrow: pa.Table) -> None:
    """Insert the rows of an Arrow table, INSERT_ROWS at a time (the casts and DuckDB's insert state stay
    that size, whatever the file's): its columns of `table` are cast to the declared types (a dictionary
    of the declared type is taken as it is), other columns ignored, missing ones NULL."""
    if not arrow.num_rows:
        return
    names = [name for name in TABLE_COLUMNS[table] if name in arrow.column_names]
    if not names:
        raise ValueError(f"no {table} columns in the table ({arrow.column_names})")
    listed = ", ".join(names)
    sql = f"INSERT INTO {table} (run_id, source_id, {listed}) SELECT ?, ?, {listed} FROM _commlens_rows"
    for start in range(0, arrow.num_rows, INSERT_ROWS):
        rows = _declared(table, arrow.select(names).slice(start, INSERT_ROWS))
        with registered(con, rows, "_commlens_rows"):
            con.execute(sql, [run_id, source_id])


def _declared(table: str, arrow: pa.Table) -> pa.Table:
    """The columns cast to `table`'s declared types; a dictionary of the declared type is kept as it is."""
    columns = TABLE_COLUMNS[table]

    def declared(col: pa.ChunkedArray, typ: pa.DataType) -> pa.ChunkedArray:
        if col.type == typ or (pa.types.is_dictionary(col.type) and col.type.value_type == typ):
            return col
        return col.cast(typ)

    cols = [declared(col, columns[name]) for name, col in zip(arrow.column_names, arrow.columns, strict=True)]
    return pa.Table.from_arrays(cols, names=arrow.column_names)


def _merge_groups(con: duckdb.DuckDBPyConnection, run_id: int, groups: list[dict[str, Any]]) -> None:
    """Insert process groups, or fill the fields an earlier source of the run left empty."""
    for g in groups:
        con.execute(
            """
            INSERT INTO process_groups (run_id, group_key, name, description, backend, ranks, size, origin, mesh_dim)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
            ON CONFLICT (run_id, group_key) DO UPDATE SET
                name = coalesce(process_groups.name, excluded.name),
                description = coalesce(process_groups.description, excluded.description),
                backend = coalesce(process_groups.backend, excluded.backend),
                ranks = coalesce(process_groups.ranks, excluded.ranks),
                size = coalesce(process_groups.size, excluded.size),
                mesh_dim = coalesce(process_groups.mesh_dim, excluded.mesh_dim)
            """,
            [
                run_id,
                g["group_key"],
                g.get("name"),
                g.get("description"),
                g.get("backend"),
                g.get("ranks"),
                g.get("size"),
                g.get("origin", "event"),
                g.get("mesh_dim"),
            ],
        )


def write_result(
    con: duckdb.DuckDBPyConnection, run_id: int, path: str, sha256: str, size: int, result: ParseResult
) -> int:
    """Write one parsed file in one transaction and return its source_id."""
    return transaction(con, lambda c: _write_result(c, run_id, path, sha256, size, result))


def _write_result(
    con: duckdb.DuckDBPyConnection, run_id: int, path: str, sha256: str, size: int, result: ParseResult
) -> int:
    # a file stored now at a path that failed before (the same bytes with another --rank or a fixed parser, or
    # the whole file where a truncated copy failed) is no longer a failure of the run
    con.execute("DELETE FROM sources WHERE run_id = ? AND path = ? AND status = 'failed'", [run_id, path])
    source_id = _one(
        con.execute(
            """
        INSERT INTO sources (run_id, path, kind, sha256, size_bytes, rank, world_size, status,
                             n_events, skipped, warnings, meta)
        VALUES (?, ?, ?, ?, ?, ?, ?, 'ok', ?, ?, ?, ?) RETURNING source_id
        """,
            [
                run_id,
                path,
                result.kind,
                sha256,
                size,
                result.rank,
                result.world_size,
                result.n_events,
                json.dumps(dict(result.skipped)),
                json.dumps(result.warnings),
                json.dumps(result.meta, default=str),
            ],
        )
    )
    _insert_rows(con, "comm_events", run_id, source_id, result.events)
    for events in _same_schema_batches(result.event_tables):
        _insert_table(con, "comm_events", run_id, source_id, events)
    _insert_rows(con, "steps", run_id, source_id, result.steps)
    if result.intervals is not None:
        _insert_table(con, "timeline_intervals", run_id, source_id, result.intervals)
    _insert_rows(con, "nccl_comms", run_id, source_id, result.nccl_comms)
    _insert_rows(con, "nccl_topology", run_id, source_id, result.topology)
    _insert_rows(con, "nccl_tuning", run_id, source_id, result.tuning)
    _insert_rows(con, "fr_entries", run_id, source_id, result.fr_entries)
    _insert_rows(con, "a2a_pairs", run_id, source_id, result.a2a_pairs)
    for table, rows in result.arrow_rows.items():
        _insert_table(con, table, run_id, source_id, rows)
    _merge_groups(con, run_id, result.groups)
    if result.run_config is not None:
        set_run_config(con, run_id, result.run_config)
    if result.world_size:
        con.execute(
            "UPDATE runs SET world_size = greatest(coalesce(world_size, 0), ?) WHERE run_id = ?",
            [result.world_size, run_id],
        )
    return source_id


def replace_run_data(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Remove a run's ingested files and everything parsed from them, in one transaction, before its files
    are ingested again (a harness run re-made with --overwrite). The run itself, its review items and
    users' scheme overrides stay; process groups without an override go (the new files bring theirs)."""

    def replace(c: duckdb.DuckDBPyConnection) -> None:
        for table in (*TRACE_TABLES, "sources", *AGG_TABLES):  # fixed names
            c.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        c.execute("DELETE FROM process_groups WHERE run_id = ? AND coalesce(scheme_source, '') <> 'override'", [run_id])
        c.execute("UPDATE runs SET config = NULL, strategy = NULL, world_size = NULL WHERE run_id = ?", [run_id])

    transaction(con, replace)


def _one(cur: duckdb.DuckDBPyConnection) -> int:
    """The single integer a RETURNING or count query gives."""
    row = cur.fetchone()
    if row is None:
        raise ValueError("the statement returned no row")
    return int(row[0])
