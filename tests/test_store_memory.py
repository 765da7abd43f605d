"""release_memory: DuckDB's cached allocations go back to the system, and the connection keeps its settings."""

from __future__ import annotations

import duckdb
import psutil

from commlens.store import release_memory


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_cached_memory_goes_back_and_the_thread_count_stays() -> None:
    con = duckdb.connect()
    con.execute("SET threads = 2")
    # ~400 MB of rows built and dropped on the worker threads: DuckDB says it holds almost nothing after
    con.execute("CREATE TEMP TABLE t AS SELECT i, i * 2 AS j, i % 7 AS k FROM range(16000000) r(i)")
    con.execute("UPDATE t SET k = k + 1")
    con.execute("DROP TABLE t")
    in_use = con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()
    assert in_use is not None and in_use[0] < 64 * 2**20
    before = _rss_mb()
    release_memory(con)
    after = _rss_mb()
    assert before - after > 100, (before, after)  # the worker threads' caches were flushed
    assert con.execute("SELECT current_setting('threads')").fetchone() == (2,)
    assert con.execute("SELECT count(*) FROM range(10)").fetchone() == (10,)


def test_one_thread_is_left_alone() -> None:
    con = duckdb.connect()
    con.execute("SET threads = 1")
    release_memory(con)
    assert con.execute("SELECT current_setting('threads')").fetchone() == (1,)
