"""Issue 17's smaller promises against real servers. Jobs a dead server left behind, as a real `commlens
serve` finds them at start: one whose every upload was ingested (the server died before linking its run)
reports `done` with the interruption noted and its run is completed; one that stopped half-way is
`failed`, saying how far it got, its results listing each file; a queued one is `failed` with nothing
stored (the store is left as a SIGKILL between two steps leaves it). And bad input named precisely: NaN
at its event, a garbled NCCL line as skipped, a trace without communication, archives inside archives."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import httpx
import pytest

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
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
        # health answers at once, "recovering" while the interrupted runs are completed, then "ok"
        assert c.get("/health").json()["status"] in ("recovering", "ok")
        deadline = time.monotonic() + 120
        while c.get("/health").json()["status"] == "recovering":
            assert time.monotonic() < deadline, "recovery did not end in 120 s"
            time.sleep(0.1)
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


def _tar(members: list[tuple[str, bytes]], mode: str = "w") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tf:
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tf.addfile(info, io.BytesIO(content))
    return out.getvalue()


def test_smaller_promises_through_a_real_server(tmp_path: Path, data_dir: Path) -> None:
    """NaN named at its event, a garbled NCCL line listed as skipped, a trace without communication saying
    so, an archive inside an archive expanded (one nested deeper refused), never read as text."""
    log = (data_dir / LOG).read_bytes()
    coll = next(line for line in log.splitlines() if b"NCCL INFO AllReduce" in line)
    kernel = {
        "ph": "X",
        "cat": "kernel",
        "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
        "pid": 0,
        "tid": 7,
        "ts": 1,
        "dur": 2,
    }
    base = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}}
    nan = json.dumps(base | {"traceEvents": [kernel, kernel | {"ts": 5}]}).replace('"dur": 2}]', '"dur": NaN}]')
    quiet = json.dumps(
        base
        | {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 0, "tid": 1, "ts": 1, "dur": 5}]}
    )
    inner = _tar([("x.log", log)], "w:gz")
    uploads = [
        ("nan.json", nan.encode()),
        ("garbled.log", log + coll[: len(coll) // 2] + b"\n"),
        ("quiet.json", quiet.encode()),
        ("outer.tar", _tar([("inner.tar.gz", inner)])),
        ("deep.tar", _tar([("mid.tar", _tar([("in.tar", _tar([("y.log", log)]))]))])),
    ]
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        results = {}
        for i, (name, data) in enumerate(uploads):
            run = f"r{i}"  # one run each: the same log twice in a run would be a duplicate
            assert c.post("/api/runs", json={"name": run}).status_code == 201
            r = c.post(f"/api/runs/{run}/files", files={"files": (name, data)})
            assert r.status_code == 202, r.text
            results.update({x["path"]: x for x in wait_job(c, r.json()["job_id"])["results"]})
    assert results["nan.json"]["status"] == "failed"
    assert results["nan.json"]["error"].startswith("nan.json:$.traceEvents[1] (line 1 column ")
    assert "NaN (the value of 'dur') is not a JSON number" in results["nan.json"]["error"]
    garbled = results["garbled.log"]
    assert (garbled["status"], garbled["events"], garbled["skipped"]) == ("ok", 4, {"COLL line cut or garbled": 1})
    garbled_line = log.count(b"\n") + 1
    assert f"garbled.log:line {garbled_line}: skipped: COLL line cut or garbled (first of 1)" in garbled["warnings"]
    quiet_out = results["quiet.json"]
    assert quiet_out["status"] == "ok" and quiet_out["events"] == 0
    assert any(
        "no communication: the trace holds no collective or point-to-point call" in w for w in quiet_out["warnings"]
    )
    assert (results["outer.tar!inner.tar.gz!x.log"]["status"], results["outer.tar!inner.tar.gz!x.log"]["events"]) == (
        "ok",
        4,
    )
    deep = results["deep.tar!mid.tar!in.tar"]
    assert deep["status"] == "failed" and deep["error"].endswith("an archive nested more than 1 deep")
    assert set(results) == {
        "nan.json",
        "garbled.log",
        "quiet.json",
        "outer.tar!inner.tar.gz!x.log",
        "deep.tar!mid.tar!in.tar",
    }
