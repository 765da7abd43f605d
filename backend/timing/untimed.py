"""The calls of a run without times (NCCL logs), read for the time analysis with as little work as the
untimed case allows.

An NCCL log gives no time, so its run gets instances, their members, mismatches and time_status, and
nothing the times would give (waits, breakdown, critical path). `load_run` reads every run the same
way: each column through Arrow's fill_null, a cast to int64 and a concatenation of the record batches,
the two time columns included (0.6-1.1 CPU s for the bench's 2 M-call logs on a loaded 2-core host).
A run qualifies here only when no counted call of a known rank has a time and the run has no profiler
step, no timeline interval and no profiler trace (so every rank's timeline is empty, as load_run would
make it); its calls are read once into preallocated columns (a batch without nulls is copied straight
from its Arrow buffer) and its time columns are not read (0.2-0.55 CPU s). The CallTable is the one
load_run builds, value for value (tests/test_time_untimed.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import duckdb
import numpy as np
import numpy.typing as npt
import pyarrow as pa


def untimed_only(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    """Whether the run's counted calls of known rank carry no time and nothing else of the run could
    (profiler steps, timeline intervals, profiler traces): the runs `read_columns` serves."""
    rows = con.execute(
        """
        SELECT NOT EXISTS (SELECT 1 FROM steps WHERE run_id = $run)
           AND NOT EXISTS (SELECT 1 FROM timeline_intervals WHERE run_id = $run)
           AND NOT EXISTS (SELECT 1 FROM sources WHERE run_id = $run AND status = 'ok' AND kind = 'kineto')
           AND NOT EXISTS (SELECT 1 FROM comm_events e JOIN sources s USING (source_id)
                           WHERE e.run_id = $run AND e.counted AND e.rank IS NOT NULL AND e.ts_us IS NOT NULL)
        """,
        {"run": run_id},
    ).fetchall()
    return bool(rows[0][0])


def read_columns(
    con: duckdb.DuckDBPyConnection,
    sql: str,
    params: dict[str, Any],
    n: int,
    batch_rows: int,
    ints: Mapping[str, int],
    flagged: Sequence[str] = (),
) -> dict[str, npt.NDArray[Any]]:
    """A query's `n` rows as int64 numpy columns, filled in place `batch_rows` at a time: `ints` with the
    value given for null, `flagged` with null as 0 and a `has_<name>` flag (what persist._fetch gives,
    without its intermediate copies)."""
    out: dict[str, npt.NDArray[Any]] = {name: np.empty(n, dtype=np.int64) for name in (*ints, *flagged)}
    out |= {f"has_{name}": np.empty(n, dtype=bool) for name in flagged}
    at = 0
    for batch in con.sql(sql, params=params).to_arrow_reader(batch_rows):
        end = at + batch.num_rows
        if end > n:
            raise RuntimeError(f"the query returned more than the {n} rows counted")
        cols = dict(zip(batch.schema.names, batch.columns, strict=True))
        for name, null in (*ints.items(), *((f, 0) for f in flagged)):
            col = cols[name]
            if name in flagged:
                out[f"has_{name}"][at:end] = True if not col.null_count else _valid(col)
            out[name][at:end] = _numbers(col if not col.null_count else col.fill_null(null))
        at = end
        del batch, cols
    if at != n:
        raise RuntimeError(f"the query returned {at} rows, {n} counted")
    return out


def _numbers(col: pa.Array) -> npt.NDArray[Any]:
    return np.asarray(col.to_numpy(zero_copy_only=False))


def _valid(col: pa.Array) -> npt.NDArray[np.bool_]:
    return np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
