"""The server's one DuckDB connection: a cursor per request or thread, conflict retries for writes.

DuckDB allows one writing process per file. The server holds the file for its lifetime; every request
works on its own cursor (a connection sharing the same database instance), so reads run while the
ingest queue writes. Concurrent transactions touching the same rows fail with TransactionException;
the service retries small writes a few times (commlens.store.transaction) before the client sees a 409.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb

from commlens import store
from commlens.store import aggregates

log = logging.getLogger("commlens.api.db")


class Database:
    def __init__(self, path: Path):
        self.path = path
        self._con: duckdb.DuckDBPyConnection | None = store.connect(path)
        self._lock = threading.Lock()
        self._refresh_aggregates(self._con)

    @staticmethod
    def _refresh_aggregates(con: duckdb.DuckDBPyConnection) -> None:
        """Bring every run's aggregates up to date before requests arrive (a store upgraded from schema
        1, or rows written by other tools); analyses would otherwise do it on the run's first read."""
        try:
            n = aggregates.refresh_all(con)
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
