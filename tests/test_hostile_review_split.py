"""Issue 17 items 3 and 5 through an upload that splits into jobs: the run split off is the uploader's.

An upload whose files show two jobs stores the second as run `<run>-<stem of its first file>`. That name used
to be chosen without looking at the store, so another user's existing run of that name received the files;
and a run made by the split had no owner, so the user whose upload made it could not rename it. Now a split
takes no name of another owner's run (nor any run's former name) and the runs it makes belong to the uploader
(`service.ingest._ingest_split`)."""

from __future__ import annotations

from pathlib import Path

import httpx

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
from commlens.ingest.inputs import iter_inputs
from commlens.service import runs, users
from commlens.service.ingest import ingest_run
from commlens.service.users import Actor

MINE = "nccl-logs/nvidia-nccl-584.log"  # one process on two communicators
OTHER = "nccl-logs/nvidia-nccl-1238.log"  # another job: no communicator, rank or time in common


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _split_upload(c: httpx.Client, token: str, data_dir: Path) -> dict[str, str]:
    """jack uploads his log and an unrelated one into his run 'exp': the path -> run each went to."""
    files = [
        ("files", ("mine.log", (data_dir / MINE).read_bytes())),
        ("files", ("other.log", (data_dir / OTHER).read_bytes())),
    ]
    r = c.post("/api/runs/exp/files", files=files, headers=_bearer(token))
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["job_id"])
    assert job["state"] == "done" and {x["status"] for x in job["results"]} == {"ok"}, job
    return {x["path"]: x["run"] for x in job["results"]}


def test_a_split_never_writes_into_another_users_run(tmp_path: Path, data_dir: Path) -> None:
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        jack = c.post("/api/users", json={"name": "jack"}).json()["token"]
        kate = c.post("/api/users", json={"name": "kate"}).json()["token"]
        assert c.post("/api/runs", json={"name": "exp"}, headers=_bearer(jack)).status_code == 201
        assert c.post("/api/runs", json={"name": "exp-other"}, headers=_bearer(kate)).status_code == 201
        where = _split_upload(c, jack, data_dir)
        assert where["mine.log"] == "exp"
        assert where["other.log"] == "exp-other-2"  # kate's run does not receive jack's file
        assert c.get("/api/runs/exp-other/sources").json()["items"] == []


def test_the_uploader_owns_the_runs_an_upload_split_off(tmp_path: Path, data_dir: Path) -> None:
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        jack = c.post("/api/users", json={"name": "jack"}).json()["token"]
        assert c.post("/api/runs", json={"name": "exp"}, headers=_bearer(jack)).status_code == 201
        where = _split_upload(c, jack, data_dir)
        split_off = where["other.log"]
        assert split_off == "exp-other"
        assert c.get(f"/api/runs/{split_off}").json()["owner"] == "jack"
        assert c.patch(f"/api/runs/{split_off}", json={"name": "exp-b"}, headers=_bearer(jack)).status_code == 200


def test_a_cli_split_takes_no_users_run_nor_a_former_name(tmp_path: Path, data_dir: Path) -> None:
    """The CLI's split (no owner): a user's run of the split-off name and a former name are passed over; its own
    ownerless run of that name is added to, so an ingest run again lands where it did."""
    files = [data_dir / MINE, tmp_path / "other.log"]
    files[1].write_bytes((data_dir / OTHER).read_bytes())
    con = store.connect(tmp_path / "s.duckdb")
    try:
        kate = users.user_by_token(con, users.add_user(con, "kate"))
        assert kate is not None
        runs.create_run(con, "exp-other", owner=Actor("kate", kate.user_id, False))
        runs.create_run(con, "old")
        runs.rename_run(con, "old", "exp-other-2")
        runs.rename_run(con, "exp-other-2", "renamed")  # 'exp-other-2' is now a former name
        first = ingest_run(con, "exp", iter_inputs(files), split_jobs=True)
        assert {Path(f.path).name: f.run for f in first.files} == {
            MINE.split("/")[1]: "exp",
            "other.log": "exp-other-3",
        }
        again = ingest_run(con, "exp", iter_inputs(files), split_jobs=True)
        assert [f.run for f in again.files] == ["exp", "exp-other-3"]
        assert [f.status for f in again.files] == ["duplicate", "duplicate"]
        assert runs.run_detail(con, "exp-other-3")["owner"] is None
    finally:
        con.close()
