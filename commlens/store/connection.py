"""Opening a store: creating a new one, upgrading an older one, refusing what is not a commlens store."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from .errors import StoreError
from .migrations import check_version, create, migrate


def connect(path: str | Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open (creating if needed) a commlens store and check its schema version."""
    path = str(path)
    try:
        con = duckdb.connect(path, read_only=read_only)
    except duckdb.IOException as exc:
        msg = str(exc)
        if "lock" in msg.lower():
            holder = re.search(r"PID (\d+)", msg)
            who = f" (process {holder.group(1)})" if holder else ""
            raise StoreError(
                f"{path} is held by another process{who}, probably `commlens serve`. DuckDB allows one "
                "writer: stop that process, or upload through its API (POST /api/runs/{run}/files)."
            ) from None
        raise StoreError(f"cannot open {path}: {msg}") from None
    except duckdb.Error as exc:
        raise StoreError(f"cannot open {path} as a DuckDB database: {exc}") from None
    if read_only:
        check_version(con, path)
        return con
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "meta" not in tables:
        if tables:
            con.close()
            raise StoreError(f"{path} is a DuckDB database but not a commlens store (tables: {sorted(tables)})")
        create(con)
    else:
        migrate(con, path)
    return con


def release_memory(con: duckdb.DuckDBPyConnection) -> None:
    """Give back the memory DuckDB's allocator keeps cached in its worker threads once a large statement is
    done. After the insert and linking of 5 M calls it reported 10 MB in use while 270 MB more stayed
    resident until the process ended; restarting the worker threads (the same count) flushes their caches.
    In-flight statements of other cursors finish on their own threads."""
    threads = con.execute("SELECT current_setting('threads')").fetchone()
    if threads is None or int(threads[0]) < 2:
        return  # one thread: the caller's own, nothing cached in workers
    con.execute("SET threads = 1")
    con.execute(f"SET threads = {int(threads[0])}")
