"""Period detection a batch of sources at a time (`aggregates.PERIOD_BATCH_CALLS`): every aggregate table is the
same, row for row, whether a run's sources are taken all at once or each alone, on the real NCCL logs (one source
each), bench-shaped per-process files (eight sources whose periods are found) and a Kineto trace (profiler
steps: no period detection), ingested together into one run (as `commlens ingest --one-run` does)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from conftest import shared_data
from nccl_bench import nccl_bench

from commlens import store
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run
from commlens.store import aggregates
from commlens.store.tables import AGG_TABLES

KINETO = "kineto-hta/nccl_parser_config/nccl_data.json.gz"


def _store(db: Path, paths: list[Path], batch: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple]]:
    batches: list[int] = []
    source_batches = aggregates._source_batches

    def counted(con: duckdb.DuckDBPyConnection, run_id: int) -> list[tuple[int, int]]:
        out = source_batches(con, run_id)
        batches.append(len(out))
        return out

    with monkeypatch.context() as m:
        m.setattr(aggregates, "PERIOD_BATCH_CALLS", batch)
        m.setattr(aggregates, "_source_batches", counted)
        con = store.connect(db)
        try:
            ingest_run(con, "mixed", iter_inputs(paths), split_jobs=False)
        finally:
            con.close()
    con = duckdb.connect(str(db), read_only=True)
    try:
        tables = {}
        for table in AGG_TABLES:
            cols = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall() if not r[1].startswith("TIMESTAMP")]
            tables[table] = sorted(con.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall(), key=repr)
        tables["batches"] = [(max(batches),)]
        tables["sources"] = con.execute(
            """SELECT count(DISTINCT e.source_id) FROM comm_events e
               JOIN agg_sources s ON s.run_id = e.run_id AND s.source_id = e.source_id AND NOT s.has_steps
               WHERE e.counted"""
        ).fetchall()
        return tables
    finally:
        con.close()


def test_period_detection_in_batches_of_sources_equals_all_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = shared_data()
    logs = sorted((data / "nccl-logs").glob("*.log"))
    folder = tmp_path / "per-process"
    folder.mkdir()
    nccl_bench().write_per_process(folder, 40_000, "2.21.5")
    paths = [*logs, *sorted(folder.iterdir()), data / KINETO]

    whole = _store(tmp_path / "whole.duckdb", paths, 1 << 40, monkeypatch)
    alone = _store(tmp_path / "alone.duckdb", paths, 1, monkeypatch)
    batches = alone.pop("batches")[0][0]
    assert whole.pop("batches") == [(1,)]
    sources = whole["sources"][0][0]  # the NCCL files with calls counted (the Kineto trace has steps)
    assert sources >= len(list(folder.iterdir())) + 4
    assert batches == sources  # each its own batch
    assert whole == alone
    assert any(it for _, _, _, _, it, _ in whole["process_iterations"])  # periods were found
    assert len({row[1] for row in whole["comm_periods"]}) == sources
