"""The hang analysis of a stored run (commlens.backend.hang over its Flight Recorder entries) and which
files describe each rank, for the API and the dashboard's run overview. Raises UnknownRunError (a
LookupError) for a run that does not exist."""

from __future__ import annotations

import duckdb

from commlens.backend.hang import analyze, load_calls
from commlens.backend.iterations import run_id_of
from commlens.contract.hang import HangReport, RankSource, RankSources, RankSourcesReport


def hang_report(con: duckdb.DuckDBPyConnection, run: str) -> HangReport:
    """Per group that did not complete: its latest collective, who arrived, who never did and why."""
    calls, dumped, groups = load_calls(con, run_id_of(con, run))
    return HangReport(run=run, dumped_ranks=sorted(dumped), groups=analyze(calls, dumped, groups))


def rank_sources(con: duckdb.DuckDBPyConnection, run: str) -> RankSourcesReport:
    """Per rank, the files that describe it (their calls of that rank, or the file's own rank) and what counts."""
    run_id = run_id_of(con, run)
    rows = con.execute(
        """WITH calls AS (
               SELECT e.rank, e.source_id, count(*) AS calls, count(*) FILTER (WHERE e.counted) AS counted
               FROM comm_events e WHERE e.run_id = ? AND e.rank IS NOT NULL GROUP BY ALL),
           own AS (
               SELECT rank, source_id, 0 AS calls, 0 AS counted FROM sources
               WHERE run_id = ? AND status = 'ok' AND rank IS NOT NULL
                 AND source_id NOT IN (SELECT source_id FROM calls))
           SELECT x.rank, s.path, s.kind, x.calls, x.counted
           FROM (SELECT * FROM calls UNION ALL SELECT * FROM own) x JOIN sources s USING (source_id)
           ORDER BY x.rank, s.kind, s.path""",
        [run_id, run_id],
    ).fetchall()
    by_rank: dict[int, list[RankSource]] = {}
    for rank, path, kind, calls, counted in rows:
        by_rank.setdefault(int(rank), []).append(
            RankSource(path=str(path), kind=str(kind), calls=int(calls), counted=int(counted))
        )
    return RankSourcesReport(run=run, ranks=[RankSources(rank=r, sources=s) for r, s in by_rank.items()])
