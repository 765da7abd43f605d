"""Many clients at once, a SIGKILL during an ingest, and the one-writer rule across processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import httpx

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
from commlens.service import review
from commlens.service.errors import InvalidError
from commlens.service.ingest import ingest_paths
from commlens.service.runs import comms_totals
from commlens.service.users import LOCAL_USER, Actor

LOGS = [
    "nvidia-nccl-1193.log",
    "nvidia-nccl-584.log",
    "nvidia-nccl-203.log",
    "nvidia-nccl-1238.log",
    "rocm-rccl-429.log",
    "nvidia-nccl-1595.log",
    "nvidia-nccl-629.log",
    "pytorch-pytorch-54232.log",
]


def dlrm_members(data: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(data / "kineto-param" / "dlrm_kineto.tar.gz") as tar:
        return sorted((Path(m.name).name, tar.extractfile(m).read()) for m in tar if m.isfile())  # type: ignore[union-attr]


def expected_counts(tmp: Path, files: dict[str, list[Path]]) -> dict[str, dict[str, int]]:
    """Calls per op of each run, ingested directly (no server) into a scratch store."""
    con = store.connect(tmp / "expected.duckdb")
    out = {}
    for run, paths in files.items():
        ingest_paths(con, paths, run)
        out[run] = comms_totals(con, run)[0]
    con.close()
    return out


def test_eight_uploaders_and_eight_readers(tmp_path: Path, data_dir: Path) -> None:
    members = dlrm_members(data_dir)
    assert len(members) == 8
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for name, data in members:
        (scratch / name).write_bytes(data)
    expected = expected_counts(
        tmp_path, {"conc": sorted(scratch.iterdir()), "logs": [data_dir / "nccl-logs" / n for n in LOGS]}
    )
    errors: list[str] = []
    stop = threading.Event()
    with ServerThread(Settings(db=tmp_path / "store.duckdb")) as srv:
        with httpx.Client(base_url=srv.url) as c:
            assert c.post("/api/runs", json={"name": "conc"}).status_code == 201
            assert c.post("/api/runs", json={"name": "logs"}).status_code == 201

        def uploader(i: int) -> list[str]:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                name, data = members[i]
                a = c.post("/api/runs/conc/files", files={"files": (name, data)})
                log = data_dir / "nccl-logs" / LOGS[i]
                # excerpts of unrelated jobs, kept in one run (split, each later one would go to a run of its own)
                b = c.post(
                    "/api/runs/logs/files", files={"files": (log.name, log.read_bytes())}, params={"one_run": "true"}
                )
                assert a.status_code == b.status_code == 202, (a.text, b.text)
                return [a.json()["job_id"], b.json()["job_id"]]

        def reader(i: int) -> int:
            paths = [
                "/api/runs",
                "/api/runs/conc",
                "/api/runs/conc/histograms",
                "/api/runs/logs/groups",
                "/api/runs/conc/export?format=csv",
                "/api/jobs",
                "/api/runs/logs/ranks",
                "/api/health",
            ]
            n = 0
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                while not stop.is_set() or n < 8:
                    r = c.get(paths[(i + n) % len(paths)])
                    if r.status_code != 200:
                        errors.append(f"{r.request.url}: {r.status_code} {r.text[:200]}")
                    n += 1
            return n

        with ThreadPoolExecutor(16) as pool:
            readers = [pool.submit(reader, i) for i in range(8)]
            job_ids = [j for ids in pool.map(uploader, range(8)) for j in ids]
            with httpx.Client(base_url=srv.url) as c:
                jobs = [wait_job(c, j, timeout=120) for j in job_ids]
            stop.set()
            reads = sum(f.result() for f in readers)
        assert errors == []
        assert reads >= 64
        assert all(j["state"] == "done" for j in jobs), [j for j in jobs if j["state"] != "done"]
        assert sorted(r["path"] for j in jobs for r in j["results"]) == sorted([m[0] for m in members] + LOGS)
        assert all(r["status"] == "ok" for j in jobs for r in j["results"])
        with httpx.Client(base_url=srv.url) as c:
            for run in ("conc", "logs"):
                detail = c.get(f"/api/runs/{run}").json()
                assert detail["ops"] == expected[run], run
                assert detail["sources"]["ok"] == 8
            assert c.get("/api/runs/conc").json()["ranks"] == 8


def test_racing_creations_of_one_user_are_one_201_and_409s(tmp_path: Path) -> None:
    """Six admins create the same user at once: one gets it, every other one the 409 `user-exists` of the
    non-racing path, never the 500 of the store's unique constraint (the name was checked before another
    request's INSERT committed)."""
    racers = 6
    with ServerThread(Settings(db=tmp_path / "store.duckdb")) as srv:
        clients = [httpx.Client(base_url=srv.url, timeout=60) for _ in range(racers)]
        try:
            for c in clients:
                assert c.get("/api/health").status_code == 200  # connected before the race
            for n in range(10):
                barrier = threading.Barrier(racers)

                def create(c: httpx.Client, name: str = f"racer{n}", barrier: threading.Barrier = barrier) -> tuple:
                    barrier.wait()
                    r = c.post("/api/users", json={"name": name})
                    return r.status_code, r.json().get("type", "")

                with ThreadPoolExecutor(racers) as pool:
                    answers = sorted(pool.map(create, clients))
                assert answers[0][0] == 201 and answers[1:] == [(409, "https://commlens.dev/problems/user-exists")] * (
                    racers - 1
                ), answers
            users = clients[0].get("/api/users").json()["items"]
            assert sorted(u["name"] for u in users) == [f"racer{n}" for n in range(10)]
        finally:
            for c in clients:
                c.close()


def test_replies_racing_their_parents_deletion_leave_no_orphan(tmp_path: Path) -> None:
    """One writer deletes an item while three reply to it (each on its own cursor of one connection, as the
    server's requests): a reply is refused as `unknown-parent` or deleted with its parent, never stored without
    it (DuckDB does not take the DELETE and a concurrent INSERT for a conflict)."""
    con = store.connect(tmp_path / "store.duckdb")
    store.ensure_run(con, "r")
    local = Actor(LOCAL_USER, None, True)
    repliers = 3
    refused = saved = 0
    try:
        for _ in range(40):
            parent = review.create_item(con, "r", local, "top", None)
            barrier = threading.Barrier(repliers + 1)

            def delete(parent: int = parent, barrier: threading.Barrier = barrier) -> None:
                cur = con.cursor()
                try:
                    barrier.wait()
                    review.delete_item(cur, parent, local)
                finally:
                    cur.close()

            def reply(parent: int = parent, barrier: threading.Barrier = barrier) -> int | None:
                cur = con.cursor()
                try:
                    barrier.wait()
                    return review.create_item(cur, "r", local, "reply", None, parent_id=parent)
                except InvalidError as exc:
                    assert exc.kind == "unknown-parent", exc
                    return None
                finally:
                    cur.close()

            with ThreadPoolExecutor(repliers + 1) as pool:
                deleted = pool.submit(delete)
                replies = [f.result() for f in [pool.submit(reply) for _ in range(repliers)]]
                deleted.result()
            refused += replies.count(None)
            saved += repliers - replies.count(None)
            orphans = con.execute(
                "SELECT item_id, parent_id FROM review_items WHERE parent_id IS NOT NULL "
                "AND parent_id NOT IN (SELECT item_id FROM review_items)"
            ).fetchall()
            assert orphans == [], (orphans, replies)
            assert con.execute("SELECT count(*) FROM review_items").fetchall() == [(0,)]  # deleted with the parent
        assert refused + saved == 40 * repliers
    finally:
        con.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(db: Path, port: int) -> subprocess.Popen:
    log = open(db.with_suffix(".log"), "ab")  # noqa: SIM115 - a file, not a pipe that could fill up
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "serve", "--db", str(db), "--port", str(port)], stdout=log, stderr=log
    )
    log.close()
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {db.with_suffix('.log').read_text()}")
        time.sleep(0.1)


def _consistent(db: Path) -> None:
    """Every stored file has all its rows, and no row belongs to a file that is not stored."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        bad = con.execute("""
            SELECT s.path, s.n_events, count(e.source_id) FROM sources s LEFT JOIN comm_events e USING (source_id)
            WHERE s.status = 'ok' GROUP BY ALL HAVING s.n_events <> count(e.source_id)""").fetchall()
        assert bad == []
        for table in ("comm_events", "steps", "nccl_comms", "nccl_topology", "nccl_tuning"):
            orphans = con.execute(
                f"SELECT count(*) FROM {table} WHERE source_id NOT IN (SELECT source_id FROM sources)"
            ).fetchone()[0]
            assert orphans == 0, table
    finally:
        con.close()


def test_sigkill_during_ingest_then_restart(tmp_path: Path, data_dir: Path) -> None:
    db, port = tmp_path / "store.duckdb", _free_port()
    url = f"http://127.0.0.1:{port}"
    first = data_dir / "kineto-hta/nccl_parser_config/nccl_data.json.gz"
    slow = data_dir / "kineto-hta/df_index_resolver/df_index_resolver.json.gz"
    proc = _start(db, port)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            c.post("/api/runs", json={"name": "killed"})
            # While the server holds the store, the CLI says so instead of corrupting it.
            cli = subprocess.run(
                [sys.executable, "-m", "commlens.cli", "ingest", str(first), "--db", str(db), "--run", "x"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert cli.returncode == 2 and "held by another process" in cli.stderr and "commlens serve" in cli.stderr
            files = [("files", (p.name, p.read_bytes())) for p in (first, slow, slow)]
            # one_run: each file is stored as soon as it is parsed (a split upload parses every file first, so
            # it would store all three at once, leaving nothing running to kill)
            job_id = c.post("/api/runs/killed/files", files=files, params={"one_run": "true"}).json()["job_id"]
            deadline = time.monotonic() + 60
            while (job := c.get(f"/api/jobs/{job_id}").json())["files_done"] < 1:
                assert job["state"] in ("queued", "running") and time.monotonic() < deadline, job
                time.sleep(0.02)
            assert job["state"] == "running"
            # Reads are served while the worker ingests: the read is answered before the job ends (no timed
            # bound, which a loaded machine would break)
            assert c.get("/api/runs/killed/histograms").status_code == 200
            assert c.get(f"/api/jobs/{job_id}").json()["state"] == "running"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    _consistent(db)
    proc = _start(db, port)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            job = c.get(f"/api/jobs/{job_id}").json()
            assert job["state"] == "failed" and "server stopped while this job was running" in job["error"]
            assert [r["path"] for r in job["results"]] == ["nccl_data.json.gz"]
            sources = c.get("/api/runs/killed/sources").json()["items"]
            assert [(s["path"], s["status"]) for s in sources] == [("nccl_data.json.gz", "ok")]
            assert c.get("/api/runs/killed").json()["events"] == job["results"][0]["events"] == 21
            assert os.listdir(str(db) + ".spool") == []
            again = c.post("/api/runs/killed/files", files={"files": (first.name, first.read_bytes())}).json()
            assert wait_job(c, again["job_id"])["results"][0]["status"] == "duplicate"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    assert "Application shutdown complete" in db.with_suffix(".log").read_text()
    _consistent(db)
