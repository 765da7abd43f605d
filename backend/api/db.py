"""The server's one DuckDB connection: a cursor per request or thread, conflict retries for writes.

DuckDB allows one writing process per file. The server holds the file for its lifetime; every request
works on its own cursor (a connection sharing the same database instance), so reads run while the
ingest worker writes. Concurrent transactions touching the same rows fail with TransactionException;
small API writes are retried a few times before the client sees a 409.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import duckdb

from commlens.ingest import aggregates, store

log = logging.getLogger("commlens.api.db")

T = TypeVar("T")


class Database:
    def __init__(self, path: Path):
        self.path = path
        self._con: duckdb.DuckDBPyConnection | None = store.connect(path)
        self._lock = threading.Lock()
        self._refresh_aggregates()

    def _refresh_aggregates(self) -> None:
        """Bring every run's aggregates up to date before requests arrive (a store upgraded from schema
        1, or rows written by other tools); analyses would otherwise do it on the run's first read."""
        try:
            n = aggregates.refresh_all(self._con)
        except duckdb.Error as exc:  # a request will try again for its run
            log.warning("refreshing the runs' aggregates failed: %s", exc)
            return
        if n:
            log.info("refreshed the aggregates of %d run(s)", n)

    def cursor(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            if self._con is None:
                raise store.StoreError(f"{self.path} is closed: the server is shutting down")
            return self._con.cursor()

    @contextmanager
    def session(self) -> Iterator[duckdb.DuckDBPyConnection]:
        cur = self.cursor()
        try:
            yield cur
        finally:
            cur.close()

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None


def transaction(cur: duckdb.DuckDBPyConnection, fn: Callable[[duckdb.DuckDBPyConnection], T], attempts: int = 5) -> T:
    """Run fn inside BEGIN/COMMIT, retrying when a concurrent transaction conflicts."""
    for attempt in range(attempts):
        cur.execute("BEGIN TRANSACTION")
        try:
            result = fn(cur)
            cur.execute("COMMIT")
            return result
        except duckdb.TransactionException:
            _rollback(cur)
            if attempt == attempts - 1:
                raise
            time.sleep(0.02 * (attempt + 1))
        except BaseException:
            _rollback(cur)
            raise
    raise AssertionError("unreachable")


def _rollback(cur: duckdb.DuckDBPyConnection) -> None:
    try:
        cur.execute("ROLLBACK")
    except duckdb.Error:
        pass  # a failed COMMIT has already ended the transaction


def retry_conflicts(fn: Callable[[], T], attempts: int = 5) -> T:
    """Call fn (which manages its own transactions) again when a concurrent transaction conflicts."""
    for attempt in range(attempts):
        try:
            return fn()
        except duckdb.TransactionException as exc:
            if attempt == attempts - 1 or "within a transaction" in str(exc):
                raise
            time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")
