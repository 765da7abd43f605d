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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import httpx

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
from commlens.backend.iterations import UnknownRunError
from commlens.service import review
from commlens.service.errors import ConflictError, InvalidError
from commlens.service.ingest import ingest_paths
from commlens.service.runs import comms_totals, delete_run, update_run
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


PROBLEM = "https://commlens.dev/problems/"


def _race(
    srv: ServerThread, racers: int, rounds: int, send: Callable[[httpx.Client, int, int], httpx.Response]
) -> None:
    """`racers` clients send at once, `rounds` times: send(client, round, racer) must give one 2xx and for every
    other racer the 409 of the non-racing path, never the 500 of the store's unique constraint (the name was
    checked free before another request's INSERT committed)."""
    clients = [httpx.Client(base_url=srv.url, timeout=60) for _ in range(racers)]
    try:
        for c in clients:
            assert c.get("/api/health").status_code == 200  # connected before the race
        for n in range(rounds):
            barrier = threading.Barrier(racers)

            def one(i: int, n: int = n, barrier: threading.Barrier = barrier) -> tuple[int, str]:
                barrier.wait()
                r = send(clients[i], n, i)
                return r.status_code, r.json().get("type", "") if r.status_code >= 400 else ""

            with ThreadPoolExecutor(racers) as pool:
                answers = sorted(pool.map(one, range(racers)))
            assert answers[0][0] in (200, 201) and [a[0] for a in answers[1:]] == [409] * (racers - 1), answers
            refusals = {a[1] for a in answers[1:]}
            assert len(refusals) == 1 and refusals <= {PROBLEM + "user-exists", PROBLEM + "run-exists"}, answers
    finally:
        for c in clients:
            c.close()


def test_racing_creations_of_one_user_are_one_201_and_409s(tmp_path: Path) -> None:
    """Six admins create the same user at once: one gets it, every other one the 409 `user-exists`."""
    with ServerThread(Settings(db=tmp_path / "store.duckdb")) as srv:
        _race(srv, 6, 10, lambda c, n, _: c.post("/api/users", json={"name": f"racer{n}"}))
        users = httpx.get(srv.url + "/api/users").json()["items"]
    assert sorted(u["name"] for u in users) == [f"racer{n}" for n in range(10)]


def test_racing_creations_and_renames_of_one_run_are_one_success_and_409s(tmp_path: Path) -> None:
    """Six writers create the run of one name at once, then six runs are renamed to one new name at once: one
    succeeds each time, every other one gets the 409 `run-exists` (a 500 before: the unique key's ConstraintException)."""
    racers = 6
    with ServerThread(Settings(db=tmp_path / "store.duckdb")) as srv:
        _race(srv, racers, 8, lambda c, n, _: c.post("/api/runs", json={"name": f"run{n}"}))
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for i in range(racers):
                assert c.post("/api/runs", json={"name": f"old{i}"}).status_code == 201
        _race(srv, racers, 1, lambda c, _, i: c.patch(f"/api/runs/old{i}", json={"name": "renamed"}))
        names = sorted(r["name"] for r in httpx.get(srv.url + "/api/runs").json()["items"])
    assert [n for n in names if n.startswith("run")] == [f"run{n}" for n in range(8)]
    assert names.count("renamed") == 1 and len(names) == 8 + racers, names


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


def _at_once(n: int, fn: Callable[[duckdb.DuckDBPyConnection, int], object], con: duckdb.DuckDBPyConnection) -> list:
    """fn(cursor, i) for i < n, each on its own cursor of one connection (as the server's requests), released
    together; each result, or the exception it raised."""
    barrier = threading.Barrier(n)

    def one(i: int) -> object:
        cur = con.cursor()
        try:
            barrier.wait()
            return fn(cur, i)
        except Exception as exc:
            return exc
        finally:
            cur.close()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_items_and_renames_racing_their_runs_deletion_leave_nothing_behind(tmp_path: Path) -> None:
    """A run is deleted while three writers add review items to it and one renames it: each write is refused as
    an unknown run or deleted with it (or, renamed first, the run outlives its old name's deletion); no item or
    alias outlives the run (DuckDB does not take the DELETE and a
    concurrent INSERT for a conflict)."""
    con = store.connect(tmp_path / "store.duckdb")
    local = Actor(LOCAL_USER, None, True)
    try:
        for n in range(30):
            store.ensure_run(con, f"r{n}")

            def act(cur: duckdb.DuckDBPyConnection, i: int, run: str = f"r{n}") -> object:
                if i == 0:
                    return delete_run(cur, run)
                if i == 1:
                    return update_run(cur, run, {"name": f"{run}-renamed"})
                return review.create_item(cur, run, local, "top", None)

            for result in _at_once(5, act, con):
                assert not isinstance(result, Exception) or isinstance(result, UnknownRunError), repr(result)
            for table in ("review_items", "run_aliases"):
                orphans = con.execute(f"SELECT count(*) FROM {table} WHERE run_id NOT IN (SELECT run_id FROM runs)")
                assert orphans.fetchall() == [(0,)], table
            # renamed first, the run outlives the deletion of its old name (the service takes stored names)
            assert con.execute("SELECT name FROM runs WHERE name LIKE ?", [f"r{n}%"]).fetchall() in (
                [],
                [(f"r{n}-renamed",)],
            )
    finally:
        con.close()


def test_one_finding_promoted_at_once_by_four_writers_is_one_item(tmp_path: Path) -> None:
    """Four writers promote the same finding at once: one item, three 409 `finding-promoted` (each checked the
    finding was not promoted before another's INSERT committed)."""
    con = store.connect(tmp_path / "store.duckdb")
    store.ensure_run(con, "r")
    local = Actor(LOCAL_USER, None, True)
    try:
        for n in range(20):
            results = _at_once(
                4, lambda cur, _, n=n: review.create_item(cur, "r", local, "x", None, finding=f"f{n}"), con
            )
            refused = [r for r in results if isinstance(r, Exception)]
            assert len(refused) == 3 and all(isinstance(r, ConflictError) for r in refused), results
        assert con.execute("SELECT count(*) FROM review_items").fetchall() == [(20,)]
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


def test_sigkill_after_every_file_of_a_split_upload_was_stored_keeps_what_went_where(
    tmp_path: Path, data_dir: Path
) -> None:
    """A server killed while it links the runs of a split upload (every file stored, the job still running)
    restarts with the job `done`, the interruption noted, and the job's table of what went where intact: the
    table was only stored once the runs were linked, and a restart reported `done` with no `jobs`."""
    db, port = tmp_path / "store.duckdb", _free_port()
    url = f"http://127.0.0.1:{port}"
    files = [("files", m) for m in dlrm_members(data_dir)]
    files.append(("files", ("other.log", (data_dir / "nccl-logs" / "nvidia-nccl-1238.log").read_bytes())))
    proc = _start(db, port)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            c.post("/api/runs", json={"name": "split"})
            job_id = c.post("/api/runs/split/files", files=files).json()["job_id"]
            deadline = time.monotonic() + 120
            # the runs' linking and analysis take most of a second after the last file is stored: poll for it
            while (job := c.get(f"/api/jobs/{job_id}").json())["files_done"] < job["files_total"]:
                assert job["state"] in ("queued", "running") and time.monotonic() < deadline, job
                time.sleep(0.002)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert job["state"] == "running", f"the job ended before the kill, nothing was tested: {job}"
    before = [(j["run"], j["files"], j["calls"]) for j in job["jobs"]]
    assert [b[0] for b in before] == ["split", "split-other"], job["jobs"]
    _consistent(db)
    proc = _start(db, port)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            job = c.get(f"/api/jobs/{job_id}").json()
            assert job["state"] == "done" and job["error"].startswith("interrupted"), job
            assert [(j["run"], j["files"], j["calls"]) for j in job["jobs"]] == before
            assert {r["run"] for r in job["results"]} == {"split", "split-other"}
            deadline = time.monotonic() + 60  # the runs are completed in the background
            while c.get("/api/runs/split-other").json()["events"] != before[1][2]:
                assert time.monotonic() < deadline, c.get("/api/runs/split-other").json()
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    _consistent(db)
