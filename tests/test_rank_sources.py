"""Which files describe each rank (GET /api/runs/{run}/rank-sources): whole per-rank traces are read from the
run's aggregates, other files' calls counted per request; both give what counting every call gives."""

from __future__ import annotations

from pathlib import Path

from conftest import shared_data
from synthetic import write_rows

from commlens import store
from commlens.service.hang import rank_sources
from commlens.service.ingest import finalize_run, ingest_paths
from commlens.store import aggregates

# Every call counted per (rank, file), as the overview read it before the aggregates: the oracle.
FULL_SCAN = """
    WITH calls AS (
        SELECT e.rank, e.source_id, count(*) AS calls, count(*) FILTER (WHERE e.counted) AS counted
        FROM comm_events e WHERE e.run_id = $run AND e.rank IS NOT NULL GROUP BY ALL),
    own AS (
        SELECT rank, source_id, 0 AS calls, 0 AS counted FROM sources
        WHERE run_id = $run AND status = 'ok' AND rank IS NOT NULL AND source_id NOT IN (SELECT source_id FROM calls))
    SELECT x.rank, s.path, s.kind, x.calls, x.counted
    FROM (SELECT * FROM calls UNION ALL SELECT * FROM own) x JOIN sources s USING (source_id)
    ORDER BY x.rank, s.kind, s.path"""


def _log_calls(ranks: dict[int, int]) -> list[dict]:
    """NCCL-log calls: `n` all-reduces of each rank (its own process)."""
    return [
        {"rank": r, "process": f"node:{100 + r}", "seq": i, "op": "all_reduce", "dtype": "float32", "msg_bytes": 4096}
        for r, n in ranks.items()
        for i in range(n)
    ]


def _flat(con, run: str) -> list[tuple]:
    return [(r.rank, s.path, s.kind, s.calls, s.counted) for r in rank_sources(con, run).ranks for s in r.sources]


def test_traces_from_aggregates_logs_counted(tmp_path: Path):
    con = store.connect(tmp_path / "s.duckdb")
    ingest_paths(con, [shared_data() / "kineto-param" / "dlrm_kineto.tar.gz"], "mix")
    run_id = store.get_run_id(con, "mix")
    # a log of ranks 0 (which a trace covers: its calls stop counting) and 9 (no trace: they count)
    write_rows(con, "mix", _log_calls({0: 3, 9: 2}), kind="nccl_log")
    finalize_run(con, run_id)
    assert aggregates.is_fresh(con, run_id)

    got = _flat(con, "mix")
    assert got == [tuple(r) for r in con.execute(FULL_SCAN, {"run": run_id}).fetchall()]
    by_rank = {}
    for rank, _, kind, calls, counted in got:
        by_rank.setdefault(rank, []).append((kind, calls, counted))
    assert sorted(by_rank) == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    assert by_rank[0] == [("kineto", 8, 8), ("nccl_log", 3, 0)]
    assert by_rank[9] == [("nccl_log", 2, 2)]
    assert all(by_rank[r] == [("kineto", 8, 8)] for r in range(1, 8))


def test_stale_aggregates_count_every_call(tmp_path: Path):
    con = store.connect(tmp_path / "s.duckdb")
    ingest_paths(con, [shared_data() / "kineto-param" / "dlrm_kineto.tar.gz"], "run")
    run_id = store.get_run_id(con, "run")
    # a file written without the run's refresh: the aggregates no longer describe the run's files
    write_rows(con, "run", _log_calls({3: 4}), kind="nccl_log")
    assert not aggregates.is_fresh(con, run_id)
    got = _flat(con, "run")
    assert got == [tuple(r) for r in con.execute(FULL_SCAN, {"run": run_id}).fetchall()]
    assert [(k, c, n) for r, _, k, c, n in got if r == 3] == [("kineto", 8, 8), ("nccl_log", 4, 4)]
