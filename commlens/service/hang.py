"""The hang analysis of a stored run (commlens.backend.hang over its Flight Recorder entries) and which
files describe each rank, for the API and the dashboard's run overview. Raises UnknownRunError (a
LookupError) for a run that does not exist."""

from __future__ import annotations

import duckdb

from commlens.backend.hang import analyze, load_calls, root_ranks
from commlens.backend.iterations import run_id_of
from commlens.contract.hang import HangReport, RankSource, RankSources, RankSourcesReport
from commlens.ingest import formats
from commlens.ingest.formats import Trait
from commlens.store import aggregates


def hang_report(con: duckdb.DuckDBPyConnection, run: str) -> HangReport:
    """Per group that did not complete: its latest collective, who arrived, who never did and why."""
    calls, dumped, groups = load_calls(con, run_id_of(con, run))
    hung = analyze(calls, dumped, groups)
    return HangReport(run=run, dumped_ranks=sorted(dumped), groups=hung, root_ranks=root_ranks(hung))


def rank_sources(con: duckdb.DuckDBPyConnection, run: str) -> RankSourcesReport:
    """Per rank, the files that describe it (their calls of that rank, or the file's own rank) and what counts.
    Only the calls of files that are not whole per-rank traces are counted here (`_whole_traces`): at 1,024
    ranks and 100 million calls, counting every call per request took seconds."""
    run_id = run_id_of(con, run)
    files = {
        sid: (path, kind, rank)
        for sid, path, kind, rank in con.execute(
            "SELECT source_id, path, kind, rank FROM sources WHERE run_id = ? AND status = 'ok'", [run_id]
        ).fetchall()
    }
    whole = _whole_traces(con, run_id)
    per_file = [(rank, sid, calls, calls) for sid, (rank, calls) in whole.items()]
    others = [sid for sid in files if sid not in whole]
    if others:
        per_file += con.execute(
            f"""SELECT rank, source_id, count(*), count(*) FILTER (WHERE counted) FROM comm_events
                WHERE run_id = ? AND rank IS NOT NULL AND source_id IN ({", ".join("?" * len(others))})
                GROUP BY ALL""",
            [run_id, *others],
        ).fetchall()
    with_calls = {sid for _, sid, _, _ in per_file}
    per_file += [(rank, sid, 0, 0) for sid, (_, _, rank) in files.items() if rank is not None and sid not in with_calls]
    rows = sorted(
        ((rank, files[sid][0], files[sid][1], calls, counted) for rank, sid, calls, counted in per_file),
        key=lambda r: (r[0], r[2], r[1]),
    )
    by_rank: dict[int, list[RankSource]] = {}
    for rank, path, kind, calls, counted in rows:
        by_rank.setdefault(int(rank), []).append(
            RankSource(path=str(path), kind=str(kind), calls=int(calls), counted=int(counted))
        )
    return RankSourcesReport(run=run, ranks=[RankSources(rank=r, sources=s) for r, s in by_rank.items()])


def _whole_traces(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[int, tuple[int, int]]:
    """source_id -> (rank, calls) of the run's per-rank traces: one rank a file, every call counted (no other
    file supersedes them), so their calls per file are the run's aggregates (`agg_sources`, counted calls per
    file with the rank of its calls), read while those are fresh; empty when they are not."""
    superseded = formats.kinds_with(Trait.SUPERSEDED_BY_TRACE) + formats.kinds_with(Trait.SUPERSEDED_BY_LOG)
    kinds = [k for k in formats.kinds_with(Trait.PER_RANK_TIMED_TRACE) if k not in superseded]
    if not kinds or not aggregates.is_fresh(con, run_id):
        return {}
    rows = con.execute(
        """SELECT s.source_id, s.rank, a.calls FROM sources s
           JOIN agg_sources a ON a.run_id = s.run_id AND a.source_id = s.source_id
           WHERE s.run_id = ? AND s.status = 'ok' AND list_contains(?, s.kind) AND a.rank_key = CAST(s.rank AS VARCHAR)""",
        [run_id, kinds],
    ).fetchall()
    return {int(sid): (int(rank), int(calls)) for sid, rank, calls in rows}
