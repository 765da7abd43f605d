"""The one way to run a transaction on the store.

DuckDB has optimistic concurrency: two transactions touching the same rows conflict at COMMIT with a
TransactionException, so writes that may race (API requests, aggregate refreshes) are retried. A
helper called while its caller's transaction is open joins it: the caller commits or rolls back all.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

import duckdb

T = TypeVar("T")

CONFLICTS: tuple[type[duckdb.Error], ...] = (duckdb.TransactionException,)
# A write that checks a unique name is free, then inserts it, races another doing the same: when the other's INSERT
# committed after this transaction's snapshot was taken, this INSERT fails with a ConstraintException (not the
# TransactionException a COMMIT conflict raises); run again, the check sees the name taken and says so.
NAME_RACES: tuple[type[duckdb.Error], ...] = (*CONFLICTS, duckdb.ConstraintException)


def in_transaction(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the connection is inside an explicit transaction (in autocommit mode every statement
    gets a new transaction id; a failed BEGIN would abort the caller's transaction, so it is not tried)."""
    first = con.execute("SELECT txid_current()").fetchall()[0][0]
    return bool(con.execute("SELECT txid_current()").fetchall()[0][0] == first)


def transaction(
    con: duckdb.DuckDBPyConnection,
    fn: Callable[[duckdb.DuckDBPyConnection], T],
    attempts: int = 1,
    retry_on: tuple[type[duckdb.Error], ...] = CONFLICTS,
) -> T:
    """fn(con) between BEGIN and COMMIT, rolled back on any exception; run again (up to `attempts` times
    in all) when it fails with one of `retry_on`. Inside an open transaction fn joins it, unretried."""
    if in_transaction(con):
        return fn(con)
    for attempt in range(attempts):
        con.execute("BEGIN TRANSACTION")
        try:
            result = fn(con)
            con.execute("COMMIT")
            return result
        except retry_on:
            _rollback(con)
            if attempt == attempts - 1:
                raise
            time.sleep(0.02 * (attempt + 1))
        except BaseException:
            _rollback(con)
            raise
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def retry_conflicts(fn: Callable[[], T], attempts: int = 5) -> T:
    """Call fn (which runs its own transactions) again when a concurrent transaction conflicts."""
    for attempt in range(attempts):
        try:
            return fn()
        except duckdb.TransactionException as exc:
            if attempt == attempts - 1 or "within a transaction" in str(exc):
                raise
            time.sleep(0.02 * (attempt + 1))
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def _rollback(con: duckdb.DuckDBPyConnection) -> None:
    with contextlib.suppress(duckdb.Error):  # a failed COMMIT has already ended the transaction
        con.execute("ROLLBACK")
