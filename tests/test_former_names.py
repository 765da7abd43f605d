"""A renamed run's former name reaches it on the CLI's own paths too, as it does through the API
(docs/security.md: renames keep links working): `commlens report` and `commlens export --run` read the run it
names now, and the jobs list filtered by it lists the run's jobs (each said "no run" or listed nothing)."""

from __future__ import annotations

from pathlib import Path

import duckdb
from typer.testing import CliRunner

from commlens import store
from commlens.cli import app
from commlens.service import jobs
from commlens.service.runs import rename_run

LOG = "nccl-logs/nvidia-nccl-203.log"  # 7 calls


def test_a_former_name_reaches_the_run_in_report_export_and_jobs(tmp_path: Path, data_dir: Path) -> None:
    db = tmp_path / "s.duckdb"
    assert CliRunner().invoke(app, ["ingest", str(data_dir / LOG), "--db", str(db), "--run", "old"]).exit_code == 0
    con = store.connect(db)
    try:
        jobs.create_job(con, "j1", "old", 1, 10)
        jobs.finish_job(con, "j1", "done", None)
        rename_run(con, "old", "new")
        listed, total = jobs.list_jobs(con, 10, 0, run="old")
        assert total == 1 and [(j.job_id, j.run) for j in listed] == [("j1", "new")]
        assert jobs.list_jobs(con, 10, 0, run="nope")[1] == 0
    finally:
        con.close()
    report = CliRunner().invoke(app, ["report", "--db", str(db), "--run", "old", "--format", "md"])
    assert report.exit_code == 0, report.output
    assert "'old' is a former name of run 'new': reporting on 'new'" in report.output
    assert "# commlens report: new" in report.output
    out = tmp_path / "pq"
    export = CliRunner().invoke(app, ["export", "--parquet", str(out), "--db", str(db), "--run", "old"])
    assert export.exit_code == 0, export.output
    calls = duckdb.sql(
        f"SELECT DISTINCT run, count(*) OVER () FROM read_parquet('{out}/comms/**/*.parquet', hive_partitioning = true)"
    )
    assert calls.fetchall() == [("new", 7)]
