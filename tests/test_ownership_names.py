"""Names and families across owners: another owner's `run-...` never swallows one's files as already stored,
and user names are one name whatever their case (reserved ones included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from commlens.ingest.inputs import iter_inputs
from commlens.service.errors import ConflictError, InvalidError
from commlens.service.ingest import ingest_run
from commlens.service.users import add_user

LOG = "nccl-logs/nvidia-nccl-1193.log"


def _user_id(con, name: str) -> int:
    return int(con.execute("SELECT user_id FROM users WHERE name = ?", [name]).fetchall()[0][0])


def test_another_owners_run_of_a_longer_name_does_not_hold_ones_files(con, data_dir: Path) -> None:
    """carol's `resnet-old` holds the log; bob's `resnet` must store it (it was 'duplicate -> resnet-old', bob's
    run left empty), while bob's own `resnet-...` runs stay part of his family."""
    add_user(con, "bob")
    add_user(con, "carol")
    bob, carol = _user_id(con, "bob"), _user_id(con, "carol")
    kept = ingest_run(con, "resnet-old", iter_inputs([data_dir / LOG]), owner_id=carol, split_jobs=True)
    assert [f.status for f in kept.files] == ["ok"]
    mine = ingest_run(con, "resnet", iter_inputs([data_dir / LOG]), owner_id=bob, split_jobs=True)
    assert [(f.status, f.run) for f in mine.files] == [("ok", "resnet")]
    again = ingest_run(con, "resnet", iter_inputs([data_dir / LOG]), owner_id=bob, split_jobs=True)
    assert [f.status for f in again.files] == ["duplicate"]
    # bob's own run of the family holds it: stored once across the family, as before
    ingest_run(con, "job-2", iter_inputs([data_dir / LOG]), owner_id=bob, split_jobs=True)
    family = ingest_run(con, "job", iter_inputs([data_dir / LOG]), owner_id=bob, split_jobs=True)
    assert [(f.status, f.run) for f in family.files] == [("duplicate", "job-2")]


@pytest.mark.parametrize("name", ["Local", "ANONYMOUS", "LoCaL"])
def test_reserved_names_are_reserved_in_every_case(con, name: str) -> None:
    with pytest.raises(InvalidError, match="in any case"):
        add_user(con, name)


def test_names_differing_only_in_case_are_one_name(con) -> None:
    add_user(con, "alice", admin=True)
    with pytest.raises(ConflictError, match="user 'alice' exists already: names differing only in case are one"):
        add_user(con, "Alice")
    assert con.execute("SELECT name FROM users").fetchall() == [("alice",)]


def test_a_run_a_running_split_sends_files_to_is_busy(con) -> None:
    """A job of `sp` whose split sends a file to the existing `sp-foo`: deleting `sp-foo` meanwhile left that
    file's rows without a run while the job said it stored them. The split is recorded before any file is
    stored (the ingest queue's on_split), and the run stays busy until the job ends."""
    from commlens.service import jobs
    from commlens.service.errors import ConflictError as Busy
    from commlens.service.runs import create_run, delete_run, rename_run

    create_run(con, "sp")
    create_run(con, "sp-foo")
    jobs.create_job(con, "j1", "sp", 2, 100)
    jobs.start_job(con, "j1")
    jobs.record_progress(con, "j1", 0, 0, [], [{"run": "sp", "files": 1}, {"run": "sp-foo", "files": 1}])
    for act in (lambda: delete_run(con, "sp-foo"), lambda: rename_run(con, "sp-foo", "elsewhere")):
        with pytest.raises(Busy, match=r"run 'sp-foo' has ingest jobs in progress \(j1\)") as err:
            act()
        assert err.value.kind == "run-busy"
    jobs.finish_job(con, "j1", "done", None)
    delete_run(con, "sp-foo")


def test_job_results_name_runs_by_their_current_names(con) -> None:
    """A job's results kept a renamed run's old name, which breaks once that name is freed (its run deleted)."""
    from commlens.service import jobs
    from commlens.service.runs import create_run, rename_run

    create_run(con, "up")
    create_run(con, "up-x")
    jobs.create_job(con, "j2", "up", 2, 10)
    jobs.record_progress(
        con, "j2", 2, 10, [{"path": "a.log", "run": "up"}, {"path": "x.log", "run": "up-x"}], [{"run": "up-x"}]
    )
    jobs.finish_job(con, "j2", "done", None)
    rename_run(con, "up-x", "xlogs")
    job = jobs.get_job(con, "j2")
    assert [r["run"] for r in job.results] == ["up", "xlogs"] and [r["run"] for r in job.runs] == ["xlogs"]
    listed, _ = jobs.list_jobs(con, 10, 0)
    assert [r["run"] for r in listed[0].results] == ["up", "xlogs"]
