"""The service layer on a real DuckDB file: what every adapter (CLI, API, harness) gets from it."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from commlens import store
from commlens.contract.predict import PredictInput
from commlens.ingest.inputs import DEFAULT_LIMITS, iter_inputs
from commlens.service import ingest, jobs, review, runs, users
from commlens.service.errors import ConflictError, ForbiddenError, InvalidError, NotFoundError

RUN_JSON = {
    "schema": "commlens.run/1",
    "strategy": "ddp",
    "world_size": 2,
    "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 128, "seq_len": 16},
    "parallel": {"dp": 2},
    "groups": [{"dim": "dp", "ranks": [0, 1], "pg_name": "0"}],
}
PREDICT_INPUT = {
    "model": {"layers": 4, "hidden": 256, "heads": 8, "vocab": 1000, "seq_len": 128},
    "parallel": {"dp": 2, "tp": 2},
    "implementation": "paper",
}


def _rows_of_run(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, int]:
    return {
        t: con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id]).fetchall()[0][0]
        for t in store.RUN_TABLES
    }


# ------------------------------------------------------------------------------------- store


def test_a_new_store_has_every_owners_tables_at_the_current_version(db_path: Path) -> None:
    con = store.connect(db_path)
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    con.close()
    assert {"meta", "runs", "sources", "users", "review_items", "jobs", "comms", *store.RUN_TABLES} <= tables
    ro = store.connect(db_path, read_only=True)
    assert ro.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
        (str(store.SCHEMA_VERSION),)
    ]
    ro.close()


def test_transaction_joins_an_open_one_and_retries_a_conflict(con: duckdb.DuckDBPyConnection) -> None:
    calls = []

    def flaky(c: duckdb.DuckDBPyConnection) -> int:
        calls.append(1)
        c.execute("INSERT INTO runs (name) VALUES (?)", [f"r{len(calls)}"])
        if len(calls) == 1:
            raise duckdb.TransactionException("conflict")
        return len(calls)

    assert store.transaction(con, flaky, attempts=2) == 2
    assert [r[0] for r in con.execute("SELECT name FROM runs").fetchall()] == ["r2"]  # the first try rolled back
    con.execute("BEGIN TRANSACTION")
    store.transaction(con, lambda c: c.execute("INSERT INTO runs (name) VALUES ('inner')"))
    con.execute("ROLLBACK")  # the helper joined the open transaction: its insert goes with it
    assert [r[0] for r in con.execute("SELECT name FROM runs ORDER BY name").fetchall()] == ["r2"]


# -------------------------------------------------------------------------------------- runs


def test_create_list_rename_and_delete_a_run(con: duckdb.DuckDBPyConnection) -> None:
    runs.create_run(con, "a", "first", ["z", "b", "b"], RUN_JSON)
    runs.create_run(con, "c", tags=["other"], config=PREDICT_INPUT)
    with pytest.raises(ConflictError, match="exists already") as exc:
        runs.create_run(con, "a")
    assert exc.value.kind == "run-exists"
    with pytest.raises(InvalidError, match=r"refused: '-x'$"):
        runs.create_run(con, "d", tags=["-x"])

    items, total = runs.list_runs(con, 10, 0, tag="b")
    assert total == 1
    [a] = items
    assert (a["name"], a["description"], a["tags"], a["strategy"], a["world_size"], a["config_kind"]) == (
        "a",
        "first",
        ["b", "z"],
        "ddp",
        2,
        "run_config",
    )
    assert a["sources"] == {"total": 0, "ok": 0, "failed": 0, "by_kind": {}}
    assert runs.list_runs(con, 10, 0, q="firs")[1] == 1
    assert runs.run_layout(con, "c") == (None, 4)  # dp 2 x tp 2 from the predictor input

    assert runs.update_run(con, "a", {"name": "a2", "tags": []}) == "a2"
    assert runs.run_names(con) == ["a2", "c"]
    detail = runs.run_detail(con, "a2")
    assert (detail["tags"], detail["ops"], detail["ranks"]) == ([], {}, 0)

    run_id = store.get_run_id(con, "a2")
    assert run_id is not None
    review.create_item(con, "a2", users.Actor("alice", None, False), "note", None)
    jobs.create_job(con, "j1", "a2", 1, 10)
    with pytest.raises(ConflictError, match="ingest jobs in progress \\(j1\\)"):
        runs.delete_run(con, "a2")
    jobs.finish_job(con, "j1", "done", None)
    runs.delete_run(con, "a2")
    assert runs.run_names(con) == ["c"]
    assert set(_rows_of_run(con, run_id).values()) == {0}


def test_predict_input_for_run(con: duckdb.DuckDBPyConnection) -> None:
    runs.create_run(con, "pi", config=PREDICT_INPUT)
    runs.create_run(con, "none")
    assert runs.predict_input_for_run(con, "pi") == PredictInput.model_validate(PREDICT_INPUT)
    assert runs.predict_input_for_run(con, "none") is None
    con.execute("UPDATE runs SET config = ? WHERE name = 'none'", [json.dumps({"model": {"layers": 3}})])
    assert runs.config_kind(runs.stored_config(con, "none")) == "other"
    assert runs.predict_input_for_run(con, "none") is None  # a config, but not one the predictor reads


# ------------------------------------------------------------------------------------- users


def test_users_and_tokens(con: duckdb.DuckDBPyConnection) -> None:
    token = users.add_user(con, "alice", admin=True)
    assert token.startswith("cl_") and len(token) == 46
    with pytest.raises(ConflictError):
        users.add_user(con, "alice")
    with pytest.raises(InvalidError, match="must be 1-64 letters"):
        users.add_user(con, users.LOCAL_USER)
    found = users.user_by_token(con, token)
    assert found is not None and (found.name, found.is_admin) == ("alice", True)
    new, is_admin = users.rotate_token(con, "alice")
    assert is_admin and new != token
    assert users.user_by_token(con, token) is None
    assert users.ensure_admin(con, "ops", "s" * users.MIN_ADMIN_TOKEN_CHARS) is True
    assert [(u.name, u.is_admin) for u in users.list_users(con)] == [("alice", True), ("ops", True)]
    users.remove_user(con, "ops")
    with pytest.raises(NotFoundError):
        users.remove_user(con, "ops")
    assert users.user_count(con) == 1


# ------------------------------------------------------------------------------------ review


def _actor(con: duckdb.DuckDBPyConnection, name: str) -> users.Actor:
    users.add_user(con, name)
    return users.Actor(name, next(u.user_id for u in users.list_users(con) if u.name == name), False)


def test_review_items_replies_and_authorship(con: duckdb.DuckDBPyConnection) -> None:
    runs.create_run(con, "r")
    alice, bob, carol = (_actor(con, n) for n in ("alice", "bob", "carol"))
    top = review.create_item(con, "r", alice, "slow all_reduce", {"view": "histograms", "scheme": "dp", "rank": 3})
    reply = review.create_item(con, "r", bob, "agreed", None, parent_id=top)
    nested = review.create_item(con, "r", carol, "me too", None, parent_id=reply)
    other = review.create_item(con, "r", bob, "tp looks fine", {"view": "histograms", "scheme": "tp"})

    items, total = review.list_items(con, "r", 10, 0, inline=1, anchor={"scheme": "dp"})
    assert total == 1
    [item] = items
    assert (item["item_id"], item["author"], item["anchor"], item["replies_total"]) == (
        top,
        "alice",
        {"view": "histograms", "scheme": "dp", "rank": 3},
        2,
    )
    assert [r["item_id"] for r in item["replies"]] == [reply]  # one inline, oldest first
    assert [r["parent_id"] for r in review.list_replies(con, top, 10, 0)[0]] == [
        top,
        top,
    ]  # a reply's reply hangs under the top
    assert review.get_item(con, nested)["parent_id"] == top
    assert review.list_items(con, "r", 10, 0, inline=0, rank=3)[1] == 1

    with pytest.raises(ForbiddenError):
        review.update_item(con, top, bob, {"body": "edited"})
    review.update_item(con, top, bob, {"status": "resolved"})  # anyone may resolve
    assert review.get_item(con, top)["status"] == "resolved"
    with pytest.raises(InvalidError):
        review.create_item(con, "r", bob, "x", None, parent_id=99)
    review.delete_item(con, top, users.Actor("admin", None, True))
    assert review.list_items(con, "r", 10, 0, inline=5)[1] == 1
    assert review.list_replies(con, other, 10, 0) == ([], 0)
    with pytest.raises(NotFoundError):
        review.get_item(con, reply)  # deleted with its top-level item


def test_a_finding_is_promoted_once(con: duckdb.DuckDBPyConnection) -> None:
    runs.create_run(con, "r")
    first = review.create_item(con, "r", users.Actor("alice", 1, False), "finding", None, finding="small-p2p")
    with pytest.raises(ConflictError, match=f"is review item {first} already"):
        review.create_item(con, "r", users.Actor("bob", 2, False), "again", None, finding="small-p2p")


# -------------------------------------------------------------------------------------- jobs


def test_jobs_progress_and_restart(con: duckdb.DuckDBPyConnection) -> None:
    runs.create_run(con, "r")
    with pytest.raises(NotFoundError):
        jobs.create_job(con, "j0", "missing", 1, 1)
    job = jobs.create_job(con, "j1", "r", 2, 300)
    assert (job.run, job.state, job.files_total, job.bytes_total, job.results) == ("r", "queued", 2, 300, [])
    jobs.create_job(con, "j2", "r", 1, 5)
    jobs.start_job(con, "j1")
    jobs.record_progress(con, "j1", 1, 100, [{"upload": "a", "status": "ok"}])
    assert jobs.job_counts(con) == {"queued": 1, "running": 1}
    assert sorted(jobs.fail_unfinished(con)) == [("j1", "running"), ("j2", "queued")]
    j1 = jobs.get_job(con, "j1")
    assert (j1.state, j1.files_done, j1.bytes_done, j1.results) == ("failed", 1, 100, [{"upload": "a", "status": "ok"}])
    assert "files listed in results were stored" in (j1.error or "")
    failed, total = jobs.list_jobs(con, 1, 0, run="r", state="failed")
    assert total == 2 and len(failed) == 1


# ------------------------------------------------------------------------------------ ingest


def test_ingest_run_stores_links_and_attributes(con: duckdb.DuckDBPyConnection, data_dir: Path, tmp_path: Path) -> None:
    trace = data_dir / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz"
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(b"\x1f\x8b\x08\x00garbage")
    seen: list[str] = []
    report = ingest.ingest_run(
        con,
        "resnet",
        iter_inputs([trace, broken], DEFAULT_LIMITS),
        on_file=lambda item, outcome: seen.append(outcome.status),
        description="d",
    )
    assert report.attribution_error is None
    assert sorted(seen) == ["failed", "ok"]
    assert [f.path for f in report.failed] == [str(broken)]
    # Attributed straight away: the trace's 21 calls of its one DDP group are dp.
    assert con.execute("SELECT scheme, count(*) FROM comms WHERE run = 'resnet' GROUP BY ALL").fetchall() == [
        ("dp", 21)
    ]
    detail = runs.run_detail(con, "resnet")
    assert (detail["description"], detail["sources"]["ok"], detail["sources"]["failed"], detail["ops"]) == (
        "d",
        1,
        1,
        {"all_reduce": 15, "broadcast": 6},
    )

    before = detail["updated_at"]
    again = ingest.ingest_run(con, "resnet", iter_inputs([trace], DEFAULT_LIMITS), replace=True)
    assert [f.status for f in again.files] == ["ok"]  # replaced, not a duplicate of the bytes stored before
    assert runs.run_detail(con, "resnet")["updated_at"] > before  # its data changed (it stayed at creation)
    assert runs.run_detail(con, "resnet")["sources"] == {"total": 1, "ok": 1, "failed": 0, "by_kind": {"kineto": 1}}
