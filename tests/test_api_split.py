"""Uploads of several jobs through a real server become the same runs as the CLI's ingest makes (one run per
job, through the same service code), `one_run` merges them, and one job's archive stays one run."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import duckdb
import httpx
import pytest

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
from commlens.contract.jobs import JobOut
from commlens.frontend.page_runs import job_view
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run


def _runs_of(con: duckdb.DuckDBPyConnection) -> dict[str, list[str]]:
    """Each run with the base names of its ingested files."""
    out: dict[str, list[str]] = {}
    for run, path in con.execute(
        "SELECT r.name, s.path FROM runs r JOIN sources s USING (run_id) WHERE s.status = 'ok' ORDER BY 1, 2"
    ).fetchall():
        out.setdefault(run, []).append(Path(path.split("!")[-1]).name)
    return {run: sorted(files) for run, files in out.items()}


def _tar_gz(files: list[Path]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    return buf.getvalue()


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """The runs the CLI's ingest makes of the 19 NCCL log excerpts (the service call it makes)."""
    from conftest import shared_data

    con = store.connect(tmp_path_factory.mktemp("cli") / "s.duckdb")
    ingest_run(con, "logs", iter_inputs([shared_data() / "nccl-logs"]), split_jobs=True)
    runs = _runs_of(con)
    con.close()
    return runs


@pytest.mark.parametrize("as_archive", [True, False])
def test_nccl_log_excerpts_upload_as_the_cli_splits_them(
    tmp_path: Path, data_dir: Path, cli_runs: dict[str, list[str]], as_archive: bool
) -> None:
    logs = sorted((data_dir / "nccl-logs").iterdir())
    assert len(logs) == 19 and len(cli_runs) == 19
    if as_archive:
        files = [("files", ("logs.tar.gz", _tar_gz(logs)))]
    else:
        files = [("files", (f.name, f.read_bytes())) for f in logs]
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/api/runs", json={"name": "logs"}).status_code == 201
        r = c.post("/api/runs/logs/files", files=files)
        assert r.status_code == 202, r.text
        job = wait_job(c, r.json()["job_id"], timeout=240)
        assert job["state"] == "done" and job["error"] is None, job
        assert (job["files_done"], job["files_total"]) == (len(files), len(files))
        # the job's table: one row per run, the upload's run first, each naming its files and evidence
        table = {j["run"]: j for j in job["jobs"]}
        assert job["jobs"][0]["run"] == "logs" and job["jobs"][0]["apart"] == []
        assert {run: sorted(Path(p.split("!")[-1]).name for p in j["files"]) for run, j in table.items()} == cli_runs
        assert table["logs"]["calls"] == 4  # the first job with calls keeps the run (aws-65 has none)
        assert table["logs"]["job"].startswith("world size 128")
        assert table["logs-nvidia-nccl-1357"]["apart"] == ["world size 128 vs 16"]
        assert table["logs-aws-aws-ofi-nccl-65"]["apart"] == [
            "nothing shows they are one job (no shared communicator, rank or time)"
        ]
        # every file result names its run; the runs exist with their calls
        assert all(x["status"] == "ok" for x in job["results"])
        went = {Path(x["path"].split("!")[-1]).name: x["run"] for x in job["results"]}
        assert went == {f: run for run, fs in cli_runs.items() for f in fs}
        listed = {x["name"]: x["events"] for x in c.get("/api/runs", params={"limit": 100}).json()["items"]}
        assert listed["logs"] == 4 and listed["logs-nvidia-nccl-203"] == 7
        assert sorted(listed) == sorted(cli_runs)
        # the upload page lists each run with a link to it
        page = str(job_view(JobOut.model_validate(job)))
        assert "up-jobs" in page and "/runs/logs-nvidia-nccl-203" in page and "The files are of 19 jobs" in page
        finished = str(job_view(JobOut.model_validate(job)))
        assert "Every file is in the 19 runs above." in finished  # not "in the run" beside a list of 19
        if as_archive:
            assert all(x["upload"] == "logs.tar.gz" for x in job["results"])
        else:
            assert all(x["upload"] == Path(x["path"]).name for x in job["results"])


@pytest.mark.parametrize("how", ["query", "form"])
def test_one_run_merges_and_dlrm_stays_one_run(tmp_path: Path, data_dir: Path, how: str) -> None:
    pair = [data_dir / "nccl-logs" / f for f in ("nvidia-nccl-1193.log", "nvidia-nccl-203.log")]
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for run in ("pair", "dlrm"):
            assert c.post("/api/runs", json={"name": run}).status_code == 201
        kwargs: dict = {"params": {"one_run": "true"}} if how == "query" else {"data": {"one_run": "true"}}
        r = c.post("/api/runs/pair/files", files=[("files", (f.name, f.read_bytes())) for f in pair], **kwargs)
        assert r.status_code == 202, r.text
        merged = wait_job(c, r.json()["job_id"])
        assert merged["jobs"] == [] and [x["run"] for x in merged["results"]] == ["pair", "pair"]
        assert c.get("/api/runs/pair").json()["events"] == 11
        dlrm = data_dir / "kineto-param" / "dlrm_kineto.tar.gz"
        r = c.post("/api/runs/dlrm/files", files={"files": (dlrm.name, dlrm.read_bytes())})
        job = wait_job(c, r.json()["job_id"], timeout=120)
        assert job["jobs"] == [] and len(job["results"]) == 8
        assert {x["run"] for x in job["results"]} == {"dlrm"}
        assert sorted(x["name"] for x in c.get("/api/runs").json()["items"]) == ["dlrm", "pair"]
        bad = c.post(
            "/api/runs/pair/files", files={"files": (pair[0].name, pair[0].read_bytes())}, data={"one_run": "maybe"}
        )
        assert bad.status_code == 422 and "form field 'one_run' is 'maybe'" in bad.json()["detail"]


def test_commlens_upload_prints_the_runs_and_one_run_merges(tmp_path: Path, data_dir: Path) -> None:
    pair = [str(data_dir / "nccl-logs" / f) for f in ("nvidia-nccl-1193.log", "nvidia-nccl-203.log")]
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:

        def upload(run: str, *flags: str) -> str:
            proc = subprocess.run(
                [sys.executable, "-m", "commlens.cli", "upload", *pair, "--api", srv.url, "--run", run, *flags],
                check=False,
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "COLUMNS": "400"},
            )
            assert proc.returncode == 0, proc.stderr
            return proc.stdout

        split = upload("two")
        assert "The files are of 2 jobs: each is a run of its own (--one-run stores them all)." in split
        assert "two-nvidia-nccl-203: 1 file(s), world size 2" in split
        assert "The files are of" not in upload("one", "--one-run")
        runs = {x["name"]: x["events"] for x in c.get("/api/runs").json()["items"]}
        assert runs == {"two": 4, "two-nvidia-nccl-203": 7, "one": 11}


def test_commlens_upload_says_its_mistakes_and_leaves_no_run_behind(tmp_path: Path, data_dir: Path) -> None:
    """A missing path or a name the API refuses is one error line (it was a traceback); an upload the server
    refuses before queueing anything takes the run made for it away again (an empty run stayed)."""
    log = str(data_dir / "nccl-logs" / "nvidia-nccl-1193.log")
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "empty.log").write_bytes(b"")
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:

        def upload(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "commlens.cli", "upload", *args, "--api", srv.url],
                check=False,
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "COLUMNS": "400"},
            )

        missing = upload(str(tmp_path / "nope.log"), "--run", "u1")
        assert missing.returncode == 2 and missing.stderr.strip() == (
            f"error: {tmp_path / 'nope.log'}: No such file or directory"
        ), missing.stderr
        bad_name = upload(log, "--run", "a/b")
        assert bad_name.returncode == 2 and "Traceback" not in bad_name.stderr
        assert bad_name.stderr.startswith("error: --run 'a/b': a run made through the API is named with letters")
        refused = upload(str(tmp_path / "up"), "--run", "u2")  # an empty file: refused, nothing queued
        assert refused.returncode == 2 and "Nothing of this upload was queued" in refused.stderr, refused.stderr
        assert c.get("/api/runs").json()["items"] == []
        assert upload(log, "--run", "u3", "--rank", "-1").returncode == 2
        assert c.get("/api/runs").json()["items"] == []


def test_commlens_upload_walks_a_directory_as_ingest_does(tmp_path: Path, data_dir: Path) -> None:
    """Sub-folders are read and notes or images beside the traces are passed over, as `commlens ingest` does
    (the upload refused a whole folder for its .png, and stored a README.md as a failed NCCL log)."""
    folder = tmp_path / "job"
    (folder / "rank1").mkdir(parents=True)
    (folder / "nccl.log").write_bytes((data_dir / "nccl-logs/nvidia-nccl-1193.log").read_bytes())
    (folder / "rank1" / "nccl.log").write_bytes((data_dir / "nccl-logs/nvidia-nccl-203.log").read_bytes())
    (folder / "README.md").write_text("# how this job was run\n")
    (folder / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "commlens.cli",
                "upload",
                str(folder),
                "--run",
                "walked",
                "--api",
                srv.url,
                "--one-run",
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "400"},
        )
        assert proc.returncode == 0, proc.stderr
        said = " ".join(proc.stderr.split())
        for name in ("README.md", "loss.png"):
            suffix = Path(name).suffix
            assert f"passed over {folder / name}: not a trace ({suffix} files are passed over in directories)" in said
        (run,) = c.get("/api/runs").json()["items"]
        assert (run["name"], run["events"]) == ("walked", 4 + 7)  # both logs, the nested one too
    local = subprocess.run(
        [
            sys.executable,
            "-m",
            "commlens.cli",
            "ingest",
            str(folder),
            "--run",
            "walked",
            "--one-run",
            "--db",
            str(tmp_path / "local.duckdb"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert local.returncode == 0, local.stderr
    con = store.connect(tmp_path / "local.duckdb", read_only=True)
    assert con.execute("SELECT count(*) FROM comm_events").fetchone() == (4 + 7,)
    con.close()


def test_uploads_one_by_one_split_as_one_upload_of_them_all(tmp_path: Path, data_dir: Path) -> None:
    """A later upload whose job the run's stored files contradict (world size 1, then 8) goes to a run of its
    own, as the two files in one upload do; the same file uploaded again stays where it is."""
    one = data_dir / "kineto-hta/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
    with tarfile.open(data_dir / "kineto-param/dlrm_kineto.tar.gz") as tar:
        member = next(m for m in tar if m.name.endswith(".pt.trace.json") and "worker1_" in m.name)
        worker1 = (Path(member.name).name, tar.extractfile(member).read())  # type: ignore[union-attr]
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:

        def upload(name: str, data: bytes) -> JobOut:
            job = c.post("/api/runs/mix/files", files={"files": (name, data)})
            assert job.status_code == 202, job.text
            return JobOut.model_validate(wait_job(c, job.json()["job_id"]))

        assert c.post("/api/runs", json={"name": "mix"}).status_code == 201
        first = upload(one.name, one.read_bytes())
        assert first.state == "done" and not first.jobs and [r.run for r in first.results] == ["mix"]
        second = upload(*worker1)
        split_off = "mix-worker1_step_12.1694128201556"
        assert [(j.run, j.apart) for j in second.jobs] == [
            (split_off, ["world size 1 vs 8 (run mix holds files of another job)"])
        ]
        assert [(r.run, r.status) for r in second.results] == [(split_off, "ok")]
        again = upload(*worker1)
        assert [(r.run, r.status) for r in again.results] == [(split_off, "duplicate")]
        assert {r["name"]: r["events"] for r in c.get("/api/runs").json()["items"]} == {"mix": 35, split_off: 8}
