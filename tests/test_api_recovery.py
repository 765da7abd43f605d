"""Jobs a dead server left behind, as a real `commlens serve` finds them at start: one whose every upload was
ingested (the server died before linking its run) reports `done` with the interruption noted and its run is
completed; one that stopped half-way is `failed`, saying how far it got, its results listing each file; a
queued one is `failed` with nothing stored. The store is left as a SIGKILL between two steps leaves it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import httpx
import pytest

from commlens import store
from commlens.ingest.inputs import iter_inputs
from commlens.ingest.records import RankHint
from commlens.service import jobs, runs
from commlens.service.ingest import ingest_file

ROOT = Path(__file__).resolve().parents[1]
LOG = "nccl-logs/nvidia-nccl-1238.log"  # 4 all_reduce calls
OTHER = "nccl-logs/nvidia-nccl-203.log"  # 7 calls


def _stored_without_finishing(
    con: duckdb.DuckDBPyConnection, run: str, job_id: str, paths: list[Path], total: int
) -> None:
    """What a server killed after ingesting `paths` of a job of `total` uploads leaves: rows of each file,
    the job running with its progress, the run neither linked nor analysed."""
    run_id = store.get_run_id(con, run)
    assert run_id is not None
    jobs.create_job(con, job_id, run, total, sum(p.stat().st_size for p in paths))
    jobs.start_job(con, job_id)
    results = []
    for item in iter_inputs(paths):
        outcome = ingest_file(con, run_id, item, RankHint())
        results.append({"upload": Path(item.name).name, "path": Path(item.name).name, "status": outcome.status})
    jobs.record_progress(con, job_id, len(paths), sum(p.stat().st_size for p in paths), results)


@pytest.fixture
def served(tmp_path: Path, data_dir: Path) -> Iterator[str]:
    db = tmp_path / "s.duckdb"
    con = store.connect(db)
    try:
        for name in ("whole", "half", "waiting"):
            runs.create_run(con, name)
        _stored_without_finishing(con, "whole", "j-whole", [data_dir / LOG], 1)
        _stored_without_finishing(con, "half", "j-half", [data_dir / OTHER], 2)
        jobs.create_job(con, "j-waiting", "waiting", 1, 10)
    finally:
        con.close()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "serve", "--db", str(db), "--port", "0", "--no-ui"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = ""
    try:
        deadline = time.monotonic() + 60
        while not url:
            assert proc.poll() is None, "commlens serve exited: " + (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "commlens serve did not start in 60 s"
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", (tmp_path / "serve.log").read_text())
            url = m.group(1) if m else ""
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_jobs_left_by_a_dead_server_say_what_was_stored(served: str) -> None:
    with httpx.Client(base_url=served + "/api", timeout=60) as c:
        assert c.get("/health").json()["status"] == "ok"
        whole = c.get("/jobs/j-whole").json()
        assert whole["state"] == "done"
        assert whole["error"].startswith("interrupted: the server stopped after every file of this job was ingested")
        assert [(r["path"], r["status"]) for r in whole["results"]] == [("nvidia-nccl-1238.log", "ok")]
        half = c.get("/jobs/j-half").json()
        assert half["state"] == "failed"
        assert half["error"].startswith("the server stopped while this job was running, after 1 of 2 uploaded files")
        assert [r["status"] for r in half["results"]] == ["ok"]
        waiting = c.get("/jobs/j-waiting").json()
        assert (waiting["state"], waiting["error"]) == (
            "failed",
            "the server stopped before this job started; nothing of it was stored: upload again",
        )
        # the interrupted job's run is completed in the background: linked, refreshed, its calls counted
        deadline = time.monotonic() + 60
        while c.get("/runs/whole").json()["events"] != 4:
            assert time.monotonic() < deadline, c.get("/runs/whole").json()
            time.sleep(0.05)
        assert c.get("/runs/whole/sources").json()["items"][0]["n_events"] == 4
