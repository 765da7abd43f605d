"""Identity and ownership (issue 17 item 5) against real uvicorn servers on loopback: review items belong
to a user id, not a name; the last admin stays; runs have owners who (with admins) alone rename them, and a
former name keeps reaching the run in the API and in the dashboard (a real Chromium). And the 7 -> 8 upgrade
of a store written at schema 7."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import duckdb
import httpx
import pytest

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
from commlens.service import review, runs, users
from commlens.service.errors import ConflictError, ForbiddenError

LOG = "nccl-logs/nvidia-nccl-1238.log"  # 4 all_reduce calls of 128 MiB on one rank
CHROMIUM = Path(os.environ.get("COMMLENS_CHROMIUM", "/usr/bin/chromium"))


def _tokens(db: Path, *names: str) -> dict[str, dict[str, str]]:
    """Users (the first an admin) and their Authorization headers."""
    con = store.connect(db)
    try:
        return {n: {"Authorization": f"Bearer {users.add_user(con, n, admin=i == 0)}"} for i, n in enumerate(names)}
    finally:
        con.close()


def _direct(srv: ServerThread) -> duckdb.DuckDBPyConnection:
    """A cursor on the server's own store (DuckDB lets one process hold the file)."""
    return srv.app.state.ctx.db.cursor()


# ------------------------------------------------------------------------------------ upgrade


def _v7_schema() -> str:
    """Schema 7: today's DDL less what 7 -> 8 adds (the two columns and run_aliases)."""
    v7 = store.schema_sql()
    for ddl in store.MIGRATIONS[7]:
        if ddl.startswith("CREATE TABLE"):
            v7 = v7.replace(ddl, "")
    v7 = re.sub(r",\n\s+(owner_id|author_id)\s+INTEGER[^\n]*", "", v7)
    assert "owner_id" not in v7 and "author_id" not in v7 and "run_aliases" not in v7
    return v7


def test_a_schema_7_store_upgrades_with_its_rows_and_authors_mapped_by_name(tmp_path: Path) -> None:
    db = tmp_path / "v7.duckdb"
    con = duckdb.connect(str(db))
    con.execute(_v7_schema())
    con.execute("INSERT INTO meta VALUES ('schema_version', '7')")
    con.execute(
        "INSERT INTO users (user_id, name, is_admin, token_hash) VALUES (1, 'ana', true, 'h1'), (2, 'bo', false, 'h2')"
    )
    con.execute("INSERT INTO runs (run_id, name, description, tags) VALUES (1, 'old-run', 'kept', ['t'])")
    con.execute(
        "INSERT INTO sources (source_id, run_id, path, kind, sha256, size_bytes, status, n_events) "
        "VALUES (1, 1, 'x.log', 'nccl_log', 'abc', 10, 'ok', 2)"
    )
    con.execute(
        "INSERT INTO comm_events (run_id, source_id, seq, rank, op, dtype, msg_bytes, group_key, step, ts_us, dur_us) "
        "VALUES (1, 1, 0, 0, 'all_reduce', 'float32', 1024, 'g', 0, 5.0, 2.0), "
        "(1, 1, 1, 1, 'broadcast', 'bfloat16', 64, 'g', 0, 6.0, 1.0)"
    )
    con.execute(
        "INSERT INTO review_items (item_id, run_id, parent_id, author, body) VALUES "
        "(1, 1, NULL, 'ana', 'first'), (2, 1, 1, 'bo', 'reply'), (3, 1, NULL, 'gone', 'by a deleted user'), "
        "(4, 1, NULL, 'local', 'tokenless')"
    )
    before = con.execute("SELECT run, rank, op, dtype, msg_bytes FROM comms ORDER BY rank").fetchall()
    con.close()

    con = store.connect(db)
    try:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
            (str(store.SCHEMA_VERSION),)
        ]
        assert con.execute("SELECT run, rank, op, dtype, msg_bytes FROM comms ORDER BY rank").fetchall() == before
        assert before == [("old-run", 0, "all_reduce", "float32", 1024), ("old-run", 1, "broadcast", "bfloat16", 64)]
        assert con.execute("SELECT item_id, author, author_id, body FROM review_items ORDER BY item_id").fetchall() == [
            (1, "ana", 1, "first"),
            (2, "bo", 2, "reply"),
            (3, "gone", None, "by a deleted user"),
            (4, "local", None, "tokenless"),
        ]
        assert con.execute("SELECT name, description, tags, owner_id FROM runs").fetchall() == [
            ("old-run", "kept", ["t"], None)
        ]
        assert con.execute("SELECT count(*) FROM run_aliases").fetchall() == [(0,)]
        items = {i["item_id"]: i for i in review.list_items(con, "old-run", 10, 0, inline=5)[0]}
        assert (items[3]["author"], items[3]["author_removed"]) == ("gone", True)
        assert (items[4]["author"], items[4]["author_removed"]) == ("local", False)
        assert (items[1]["replies"][0]["author"], items[1]["replies"][0]["author_id"]) == ("bo", 2)
        # the mapped author edits their item; nobody edits the deleted user's item as its author
        review.update_item(con, 1, users.Actor("ana", 1, False), {"body": "edited"})
        with pytest.raises(ForbiddenError, match=r"a former user named 'gone', is no longer a user .*; only an admin"):
            review.update_item(con, 3, users.Actor("local", None, False), {"body": "hijack"})
        # a run created at schema 8 takes no name a run used to have
        runs.update_run(con, "old-run", {"name": "new-run"})
        with pytest.raises(ConflictError, match="former name of run 'new-run'"):
            runs.create_run(con, "old-run")
        with pytest.raises(store.StoreError, match="former name of run 'new-run'"):
            store.ensure_run(con, "old-run")  # the CLI's and the harness's way to a new run
    finally:
        con.close()


# ------------------------------------------------------------------------------------ review


def test_review_items_belong_to_the_user_id_not_the_name(tmp_path: Path) -> None:
    """A user deleted and a new one given the same name: the new one cannot edit the old one's items,
    which keep their author's name and say the author is gone; an admin still can."""
    db = tmp_path / "s.duckdb"
    t = _tokens(db, "root", "bob")
    with ServerThread(Settings(db=db, host="0.0.0.0")) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post("/api/runs", json={"name": "r"}, headers=t["bob"]).status_code == 201
        old = c.post("/api/runs/r/review", json={"body": "old bob's"}, headers=t["bob"]).json()
        old_id = c.get("/api/me", headers=t["bob"]).json()["user_id"]
        assert (old["author"], old["author_id"], old["author_removed"]) == ("bob", old_id, False)

        assert c.delete("/api/users/bob", headers=t["root"]).status_code == 204
        created = c.post("/api/users", json={"name": "bob"}, headers=t["root"])
        assert created.status_code == 201  # names are reusable; ids are not
        new_bob = {"Authorization": f"Bearer {created.json()['token']}"}
        new_id = c.get("/api/me", headers=new_bob).json()["user_id"]
        assert new_id != old_id

        for r in (
            c.patch(f"/api/review/{old['item_id']}", json={"body": "hijacked"}, headers=new_bob),
            c.delete(f"/api/review/{old['item_id']}", headers=new_bob),
        ):
            assert r.status_code == 403
            assert r.json()["detail"].startswith(
                f"item {old['item_id']}'s author, a former user named 'bob', is no longer"
            )
        mine = c.post("/api/runs/r/review", json={"body": "new bob's"}, headers=new_bob).json()
        assert c.patch(f"/api/review/{mine['item_id']}", json={"body": "edited"}, headers=new_bob).status_code == 200
        listed = {i["item_id"]: i for i in c.get("/api/runs/r/review").json()["items"]}
        assert (listed[old["item_id"]]["body"], listed[old["item_id"]]["author_removed"]) == ("old bob's", True)
        assert (listed[old["item_id"]]["author"], listed[old["item_id"]]["author_id"]) == ("bob", old_id)
        assert (listed[mine["item_id"]]["body"], listed[mine["item_id"]]["author_removed"]) == ("edited", False)
        assert listed[mine["item_id"]]["author_id"] == new_id
        r = c.patch(f"/api/review/{old['item_id']}", json={"body": "moderated"}, headers=t["root"])
        assert r.status_code == 200 and r.json()["body"] == "moderated"


def test_the_last_admin_is_neither_deleted_nor_demoted(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    t = _tokens(db, "root", "alice")
    with ServerThread(Settings(db=db, host="0.0.0.0")) as srv, httpx.Client(base_url=srv.url) as c:
        for r in (
            c.delete("/api/users/root", headers=t["root"]),
            c.patch("/api/users/root", json={"admin": False}, headers=t["root"]),
        ):
            assert r.status_code == 409 and r.json()["type"].endswith("last-admin")
            assert "'root' is the last admin; make another user an admin first" in r.json()["detail"]
        assert c.patch("/api/users/alice", json={"admin": True}, headers=t["alice"]).status_code == 403
        promoted = c.patch("/api/users/alice", json={"admin": True}, headers=t["root"])
        assert promoted.status_code == 200 and promoted.json()["is_admin"] is True
        assert c.delete("/api/users/root", headers=t["root"]).status_code == 204  # another admin remains
        r = c.patch("/api/users/alice", json={"admin": False}, headers=t["alice"])
        assert r.status_code == 409 and "'alice' is the last admin" in r.json()["detail"]
        assert [(u["name"], u["is_admin"]) for u in c.get("/api/users", headers=t["alice"]).json()["items"]] == [
            ("alice", True)
        ]
    con = store.connect(db)
    try:
        with pytest.raises(ConflictError, match="last admin"):
            users.remove_user(con, "alice")  # the CLI's `commlens users remove` refuses alike
    finally:
        con.close()


def test_deleting_an_item_deletes_no_other_authors_replies(tmp_path: Path) -> None:
    """Deleting a top-level item deletes its replies, which are their authors' (or an admin's) to delete: its
    author is refused (409 `has-replies-of-others`, saying how many) while others' replies stand; an admin is not."""
    db = tmp_path / "s.duckdb"
    t = _tokens(db, "root", "alice", "bob", "carol")
    with ServerThread(Settings(db=db, host="0.0.0.0")) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post("/api/runs", json={"name": "r"}, headers=t["alice"]).status_code == 201

        def post(who: str, body: str, parent: int | None = None) -> int:
            r = c.post("/api/runs/r/review", json={"body": body, "parent_id": parent}, headers=t[who])
            assert r.status_code == 201, r.text
            return r.json()["item_id"]

        def bodies() -> list[str]:
            cur = _direct(srv)
            try:
                return [b for (b,) in cur.execute("SELECT body FROM review_items ORDER BY item_id").fetchall()]
            finally:
                cur.close()

        # alone in the thread: the author deletes the item and their own replies, as before
        solo = post("alice", "solo")
        post("alice", "my own reply", solo)
        assert c.delete(f"/api/review/{solo}", headers=t["alice"]).status_code == 204
        assert bodies() == []

        top = post("alice", "alice's item")
        post("alice", "alice's reply", top)
        bobs = post("bob", "bob's reply", top)
        r = c.delete(f"/api/review/{top}", headers=t["alice"])
        assert r.status_code == 409 and r.json()["type"].endswith("/has-replies-of-others"), r.text
        assert r.json()["detail"].startswith(f"item {top} has 1 reply by another author")
        post("carol", "carol's reply", top)
        post("bob", "bob again", top)
        r = c.delete(f"/api/review/{top}", headers=t["alice"])
        assert r.status_code == 409 and r.json()["detail"].startswith(f"item {top} has 3 replies by 2 other authors")
        assert bodies() == ["alice's item", "alice's reply", "bob's reply", "carol's reply", "bob again"]
        assert c.delete(f"/api/review/{bobs}", headers=t["carol"]).status_code == 403  # a reply is its author's
        assert c.delete(f"/api/review/{bobs}", headers=t["bob"]).status_code == 204
        assert c.patch(f"/api/review/{top}", json={"status": "resolved"}, headers=t["alice"]).status_code == 200
        assert c.delete(f"/api/review/{top}", headers=t["root"]).status_code == 204  # an admin deletes them all
        assert bodies() == []

        # the tokenless local user and anonymous writers own their replies by name, as their items
        cur = _direct(srv)
        try:
            anonymous = users.Actor(users.ANONYMOUS, None, False)
            item = review.create_item(cur, "r", anonymous, "anonymous item", None)
            review.create_item(cur, "r", anonymous, "anonymous reply", None, parent_id=item)
            review.delete_item(cur, item, anonymous)
            item = review.create_item(cur, "r", anonymous, "anonymous item", None)
            review.create_item(cur, "r", users.Actor(users.LOCAL_USER, None, True), "local's reply", None, item)
            with pytest.raises(ConflictError, match="has 1 reply by another author"):
                review.delete_item(cur, item, anonymous)
        finally:
            cur.close()


def test_request_booleans_are_true_or_false(tmp_path: Path) -> None:
    """`{"admin": "yes"}` (or "on", "1", 1) is no way to promote a user: request booleans are JSON true or false."""
    db = tmp_path / "s.duckdb"
    t = _tokens(db, "root", "alice")
    with ServerThread(Settings(db=db, host="0.0.0.0")) as srv, httpx.Client(base_url=srv.url) as c:
        for value in ("yes", "on", "1", "true", 1, 0, None):
            for r in (
                c.patch("/api/users/alice", json={"admin": value}, headers=t["root"]),
                c.post("/api/users", json={"name": "eve", "admin": value}, headers=t["root"]),
            ):
                assert r.status_code == 422, (value, r.text)
                assert [e["field"] for e in r.json()["errors"]] == ["admin"], r.text
                assert r.json()["detail"].startswith("invalid request: admin: Input should be a valid boolean")
        listed = c.get("/api/users", headers=t["root"]).json()["items"]
        assert [(u["name"], u["is_admin"]) for u in listed] == [("alice", False), ("root", True)]
        assert c.patch("/api/users/alice", json={"admin": True}, headers=t["root"]).json()["is_admin"] is True
        assert c.post("/api/users", json={"name": "eve", "admin": False}, headers=t["root"]).status_code == 201


# -------------------------------------------------------------------------------------- runs


def _upload(c: httpx.Client, run: str, log: Path, headers: dict[str, str]) -> None:
    r = c.post(f"/api/runs/{run}/files", files={"files": (log.name, log.read_bytes())}, headers=headers)
    assert r.status_code == 202, r.text
    assert wait_job(c, r.json()["job_id"])["state"] == "done"


def test_owners_rename_and_former_names_reach_the_run(tmp_path: Path, data_dir: Path) -> None:
    db = tmp_path / "s.duckdb"
    t = _tokens(db, "root", "alice", "bob")
    con = store.connect(db)
    store.ensure_run(con, "from-cli")  # the CLI's runs have no owner
    con.close()
    with ServerThread(Settings(db=db, host="0.0.0.0")) as srv, httpx.Client(base_url=srv.url) as c:
        made = c.post("/api/runs", json={"name": "exp"}, headers=t["bob"]).json()
        assert (made["owner"], made["aliases"]) == ("bob", [])
        _upload(c, "exp", data_dir / LOG, t["bob"])
        query = {"scheme": "other", "op": "all_reduce", "weight": "bytes"}
        shown = c.get("/api/runs/exp/histograms", params=query).json()

        r = c.patch("/api/runs/exp", json={"name": "mine-now"}, headers=t["alice"])
        assert r.status_code == 403 and r.json()["detail"].startswith("only its owner 'bob' or an admin may rename")
        assert c.patch("/api/runs/exp", json={"tags": ["seen"]}, headers=t["alice"]).json()["tags"] == ["seen"]
        assert c.patch("/api/runs/exp", json={"name": "exp-v2"}, headers=t["bob"]).json()["name"] == "exp-v2"

        # a link holding the old name: same answer, query kept, the current path named
        old = c.get("/api/runs/exp/histograms", params=query)
        now = c.get("/api/runs/exp-v2/histograms", params=query).json()
        assert old.status_code == 200 and old.json() == now and now["run"] == "exp-v2"
        assert {k: v for k, v in now.items() if k not in ("run", "iterations")} == {
            k: v for k, v in shown.items() if k not in ("run", "iterations")
        }
        assert old.headers["content-location"] == "/api/runs/exp-v2/histograms?scheme=other&op=all_reduce&weight=bytes"
        assert c.get("/api/runs/exp").json()["ops"] == {"all_reduce": 4}
        assert [r["run"] for r in c.get("/api/compare", params={"runs": "exp"}).json()["runs"]] == ["exp-v2"]
        assert (
            c.post("/api/runs/exp/review", json={"body": "via the old name"}, headers=t["alice"]).json()["run"]
            == "exp-v2"
        )
        r = c.post("/api/runs", json={"name": "exp"}, headers=t["alice"])
        assert r.status_code == 409 and "'exp' is a former name of run 'exp-v2'" in r.json()["detail"]

        assert c.patch("/api/runs/exp-v2", json={"name": "exp-final"}, headers=t["root"]).status_code == 200  # an admin
        detail = c.get("/api/runs/exp").json()
        assert (detail["name"], detail["owner"], detail["aliases"]) == ("exp-final", "bob", ["exp", "exp-v2"])
        assert c.get("/api/runs/exp-v2/sources").json()["items"][0]["path"].endswith("nvidia-nccl-1238.log")

        # no owner (the CLI's run, or the owner deleted): admins rename it
        r = c.patch("/api/runs/from-cli", json={"name": "x"}, headers=t["bob"])
        assert r.status_code == 403 and r.json()["detail"].startswith("only an admin (it has no owner) may rename")
        assert c.patch("/api/runs/from-cli", json={"name": "cli-renamed"}, headers=t["root"]).status_code == 200
        assert c.delete("/api/users/bob", headers=t["root"]).status_code == 204
        new_bob = {
            "Authorization": f"Bearer {c.post('/api/users', json={'name': 'bob'}, headers=t['root']).json()['token']}"
        }
        assert c.get("/api/runs/exp-final").json()["owner"] is None
        assert c.patch("/api/runs/exp-final", json={"name": "taken"}, headers=new_bob).status_code == 403

        # taking a former name back drops that alias; deleting the run drops the rest
        back = c.patch("/api/runs/exp-final", json={"name": "exp"}, headers=t["root"]).json()
        assert (back["name"], back["aliases"]) == ("exp", ["exp-v2", "exp-final"])
        # deleting is by the current name only, as `commlens delete` does (a former name deleted the run)
        refused = c.delete("/api/runs/exp-v2", headers=t["root"])
        assert (refused.status_code, refused.json()["type"].rsplit("/", 1)[1]) == (409, "former-name")
        assert refused.json()["detail"] == "'exp-v2' is a former name of run 'exp'; delete that one by its name"
        assert c.delete("/api/runs/exp", headers=t["root"]).status_code == 204
        for name in ("exp", "exp-v2", "exp-final"):
            assert c.get(f"/api/runs/{name}").status_code == 404
        cur = _direct(srv)
        assert cur.execute("SELECT alias FROM run_aliases").fetchall() == [("from-cli",)]
        cur.close()
        assert c.post("/api/runs", json={"name": "exp-v2"}, headers=t["alice"]).json()["owner"] == "alice"


def test_compare_takes_a_former_name_as_the_run_it_names(tmp_path: Path) -> None:
    """`GET /api/compare?runs=OLD,NEW` names one run twice, as `runs=NEW,NEW` does: 422, not the run against itself."""
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url) as c:
        for name in ("x", "other"):
            assert c.post("/api/runs", json={"name": name}).status_code == 201
        assert c.patch("/api/runs/x", json={"name": "y"}).status_code == 200
        for runs_param in ("x,y", "y,x", "y,y", "x,x", "other,x,y"):
            r = c.get("/api/compare", params={"runs": runs_param})
            assert r.status_code == 422, (runs_param, r.text)
            assert r.json()["detail"].startswith("runs must name 1 to 8 different runs"), r.text
        assert "'x' is a former name of 'y'" in c.get("/api/compare", params={"runs": "x,y"}).json()["detail"]
        r = c.get("/api/compare", params={"runs": "x,other"})
        assert r.status_code == 200 and [run["run"] for run in r.json()["runs"]] == ["y", "other"]


def test_a_dashboard_link_with_a_former_name_opens_the_run(tmp_path: Path, data_dir: Path) -> None:
    """The dashboard addresses runs by name in its URL: a copied link from before a rename lands on the
    renamed run's page with its query (HTTP 308), in a real Chromium, with the review page's authors."""
    if importlib.util.find_spec("playwright") is None or not CHROMIUM.exists():
        pytest.skip("needs playwright and Debian's Chromium (make system-test-deps)")
    from playwright.sync_api import sync_playwright

    from commlens.frontend import create_ui
    from commlens.frontend.client import ApiClient

    db = tmp_path / "s.duckdb"
    t = _tokens(db, "root", "bob")
    with ServerThread(Settings(db=db), ui=create_ui()) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post("/api/runs", json={"name": "before"}).status_code == 201  # the local user
        _upload(c, "before", data_dir / LOG, {})
        c.post("/api/runs/before/review", json={"body": "gone soon"}, headers=t["bob"])
        c.post("/api/runs/before/review", json={"body": "still here"})
        assert c.delete("/api/users/bob", headers=t["root"]).status_code == 204
        assert c.patch("/api/runs/before", json={"name": "after"}).status_code == 200

        link = "/runs/before/histograms?scheme=other&weight=bytes"
        r = c.get(link)
        assert (r.status_code, r.headers["location"]) == (308, "/runs/after/histograms?scheme=other&weight=bytes")
        assert ApiClient(srv.url).run("before").name == "after"  # a dashboard served apart reaches it too

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                page.goto(srv.url + link)
                page.wait_for_selector(".run-name")
                assert page.url == srv.url + "/runs/after/histograms?scheme=other&weight=bytes"
                assert page.locator(".run-name").inner_text() == "after"
                page.wait_for_load_state("networkidle")
                assert page.locator(".msg-error").count() == 0
                page.goto(srv.url + "/runs/before/review")
                page.wait_for_selector(".review-item .author")
                authors = sorted(page.locator(".review-item .author").all_inner_texts())
                assert authors == ["bob (former user)", "local"]
                assert page.locator(".msg-error").count() == 0
            finally:
                browser.close()
