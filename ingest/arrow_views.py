"""Arrow tables lent to DuckDB queries under a name, for as long as the queries run.

DuckDB aborts the transaction of a statement that fails, and an aborted transaction refuses the unregister that
would follow (its rollback drops the name anyway): unregistering in a plain `finally` raised that refusal in place
of the statement's own error ("Current transaction is aborted" instead of the constraint, conversion or memory
error that says what went wrong)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import duckdb
import pyarrow as pa


@contextmanager
def registered(con: duckdb.DuckDBPyConnection, table: pa.Table, name: str | None = None) -> Iterator[str]:
    """`table` under `name` (a fresh one by default) for the duration of the block; a failure in the block is the
    error raised."""
    name = name or f"_commlens_{uuid.uuid4().hex[:12]}"
    con.register(name, table)
    try:
        yield name
    except BaseException:
        with contextlib.suppress(duckdb.TransactionException):
            con.unregister(name)
        raise
    con.unregister(name)


@contextmanager
def all_registered(con: duckdb.DuckDBPyConnection, tables: Mapping[str, pa.Table]) -> Iterator[None]:
    """Every table under its own name for the duration of the block (as `registered`)."""
    with contextlib.ExitStack() as stack:
        for name, table in tables.items():
            stack.enter_context(registered(con, table, name))
        yield
