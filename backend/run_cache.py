"""Results computed from a run kept per version of the run, so a repeated request costs one small query, not
the whole computation: the findings (about 80 ms of CPU at 1,024 ranks: the comparison, the per-rank aggregates
and the timing inputs, whatever the calls) and the time breakdown's bands of ranks (an aggregate over every
(rank, step) row: about 0.6 s at 14 M rows).

The version is a digest of everything these read that a write changes: the store file, the run's row
(name, config, strategy, world size), every source row (ids and sha256: ingest appends, ids are never
reused), every process-group row (ranks, size, scheme: attribution and overrides), the aggregates' stored
fingerprints, the time analysis's status, the timing findings' inputs (rows, sums and keys). Each write to a
run (an ingest job's files and finalize, a scheme override with its re-analysis, a config, a rename or a
delete) changes at least one of them. While the run has an ingest job queued or running nothing is kept (its
finalize writes in several transactions), and a result is kept only when the version read after computing it
is the one read before (no write landed in between).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

import duckdb

from commlens.backend.iterations import run_id_of
from commlens.contract.analysis import Finding
from commlens.store.jobs import active_jobs

MAX_RESULTS = 128  # results kept (a result per run version and kind), least recently used dropped first

# One statement per table (DuckDB plans each small read on its own faster than scalar subqueries in one);
# 64-bit hashes of the rows, in key order.
_VERSION_SQL = (
    "SELECT path FROM duckdb_databases() WHERE database_name = current_database()",
    "SELECT hash(name, description, tags, config, strategy, world_size, updated_at) FROM runs WHERE run_id = $run",
    "SELECT hash(list(hash(source_id, sha256, status, rank, world_size, n_events) ORDER BY source_id)) FROM sources "
    "WHERE run_id = $run",
    "SELECT hash(list(hash(group_key, name, description, backend, ranks, size, origin, mesh_dim, scheme, "
    "scheme_source, scheme_reason, scheme_confidence) ORDER BY group_key)) FROM process_groups WHERE run_id = $run",
    "SELECT sources_fp, groups_fp FROM agg_runs WHERE run_id = $run",
    "SELECT hash(list(hash(part, ok, reason) ORDER BY part, reason)) FROM time_status WHERE run_id = $run",
    "SELECT hash(rank_steps, ranks, mean_step_us, htod_bytes, htod_busy_us, dtoh_bytes, dtoh_busy_us) "
    "FROM time_finding_runs WHERE run_id = $run",
    "SELECT count(*), sum(value_us), sum(m2_us2), sum(cells), sum(step_us) FROM time_finding_cells WHERE run_id = $run",
    "SELECT hash(list(hash(kind, key, op, n_steps, instances, top_instances, cause_rank, cause_wait_us) "
    "ORDER BY kind, key, op)) FROM time_finding_keys WHERE run_id = $run",
)

_cache: OrderedDict[tuple[Hashable, ...], Any] = OrderedDict()
_lock = threading.Lock()
T = TypeVar("T")


def run_version(con: duckdb.DuckDBPyConnection, run: str) -> tuple[str, ...] | None:
    """The run's version as the cached results see it; None while an ingest job is writing it."""
    run_id = run_id_of(con, run)
    if active_jobs(con, run_id):
        return None
    parts = [str(con.execute(sql, {"run": run_id} if "$run" in sql else None).fetchall()) for sql in _VERSION_SQL]
    return (run, str(run_id), *parts)


def cached(con: duckdb.DuckDBPyConnection, run: str, what: tuple[Hashable, ...], compute: Callable[[], T]) -> T:
    """`compute()`'s result for the run, from the cache when the same `what` (the kind of result and its
    parameters) was kept for the run's current version. The result is shared: callers must not change it."""
    version = run_version(con, run)
    key = None if version is None else (*what, *version)
    if key is not None:
        with _lock:
            if key in _cache:
                _cache.move_to_end(key)
                return cast(T, _cache[key])
    found = compute()
    if key is not None and run_version(con, run) == version:
        with _lock:
            _cache[key] = found
            while len(_cache) > MAX_RESULTS:
                _cache.popitem(last=False)
    return found


def cached_findings(con: duckdb.DuckDBPyConnection, run: str, compute: Callable[[], list[Finding]]) -> list[Finding]:
    """`compute()`'s findings of the run, from the cache when the run has not changed since they were kept."""
    return list(cached(con, run, ("findings",), lambda: list(compute())))
