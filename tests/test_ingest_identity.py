"""A file's identity is its content: the same NCCL log as `x.log` and as `x.log.gz` is stored once (CLI and
API), and a log with calls of a process already in the run (same host, pid, communicator, opCounts) is
refused naming both files. Real log: nccl-logs/nvidia-nccl-1238.log (4 all_reduce calls of one process)."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import duckdb
import httpx
import pytest

from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job

ROOT = Path(__file__).resolve().parents[1]
LOG = "nccl-logs/nvidia-nccl-1238.log"
OTHER = "nccl-logs/nvidia-nccl-1193.log"  # another process's log with calls
PROCESS = "ip-172-31-54-74:30125"


@pytest.fixture
def log_bytes(data_dir: Path) -> bytes:
    return (data_dir / LOG).read_bytes()


def _calls(db: Path, run: str) -> int:
    con = duckdb.connect(str(db), read_only=True)
    try:
        row = con.execute("SELECT count(*) FROM comms WHERE run = ?", [run]).fetchone()
    finally:
        con.close()
    assert row is not None
    return int(row[0])


def _commlens(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "commlens.cli", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )


def test_cli_counts_a_log_and_its_gzip_once(tmp_path: Path, log_bytes: bytes) -> None:
    (tmp_path / "x.log").write_bytes(log_bytes)
    (tmp_path / "x.log.gz").write_bytes(gzip.compress(log_bytes))
    db = tmp_path / "s.duckdb"
    both = _commlens("ingest", str(tmp_path / "x.log"), str(tmp_path / "x.log.gz"), "--db", str(db), "--run", "r")
    assert both.returncode == 0, both.stderr
    assert "2 files: 1 ingested, 1 already present, 0 failed" in both.stdout
    assert _calls(db, "r") == 4
    # later, alone: the gzip of a stored log is already present
    again = _commlens("ingest", str(tmp_path / "x.log.gz"), "--db", str(db), "--run", "r")
    assert again.returncode == 0, again.stderr
    assert "1 files: 0 ingested, 1 already present, 0 failed" in again.stdout
    assert _calls(db, "r") == 4


def test_cli_refuses_another_file_of_a_process_in_the_run(tmp_path: Path, log_bytes: bytes, data_dir: Path) -> None:
    lines = log_bytes.decode().splitlines(keepends=True)
    (tmp_path / "x.log").write_bytes(log_bytes)
    (tmp_path / "excerpt.log").write_text("".join(lines[2:4]))  # two of its calls, other bytes
    db = tmp_path / "s.duckdb"
    assert _commlens("ingest", str(tmp_path / "x.log"), "--db", str(db), "--run", "r").returncode == 0
    refused = _commlens("ingest", str(tmp_path / "excerpt.log"), "--db", str(db), "--run", "r")
    assert "0 ingested, 0 already present, 1 failed" in refused.stdout
    assert f"NCCL process {PROCESS} is already in this run from {tmp_path / 'x.log'}" in " ".join(
        refused.stdout.split()
    )
    assert _calls(db, "r") == 4
    # another process's log joins the run
    other = _commlens("ingest", str(data_dir / OTHER), "--db", str(db), "--run", "r", "--one-run")
    assert "1 files: 1 ingested" in other.stdout, other.stdout
    assert _calls(db, "r") > 4


def test_api_counts_a_log_and_its_gzip_once(tmp_path: Path, log_bytes: bytes) -> None:
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/api/runs", json={"name": "r"}).status_code == 201

        def upload(files: list[tuple[str, bytes]]) -> dict[str, dict[str, object]]:
            r = c.post("/api/runs/r/files", files=[("files", f) for f in files])
            assert r.status_code == 202, r.text
            job = wait_job(c, r.json()["job_id"])
            assert job["state"] == "done", job
            return {x["path"]: x for x in job["results"]}

        first = upload([("x.log", log_bytes), ("x.log.gz", gzip.compress(log_bytes))])
        assert {p: x["status"] for p, x in first.items()} == {"x.log": "ok", "x.log.gz": "duplicate"}
        assert first["x.log.gz"]["error"] == "same content (decompressed) as x.log, already ingested"
        second = upload([("renamed.gz", gzip.compress(log_bytes, compresslevel=1))])
        assert second["renamed.gz"]["status"] == "duplicate"
        lines = log_bytes.decode().splitlines(keepends=True)
        third = upload([("excerpt.log", "".join(lines[3:5]).encode())])
        assert third["excerpt.log"]["status"] == "failed"
        assert str(third["excerpt.log"]["error"]).startswith(
            f"excerpt.log: NCCL process {PROCESS} is already in this run from x.log: the same host, pid, communicator"
        )
        ok = c.get("/api/runs/r/sources", params={"status": "ok"}).json()["items"]
        assert [(s["path"], s["n_events"]) for s in ok] == [("x.log", 4)]
