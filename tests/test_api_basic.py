"""The API over a real uvicorn server: runs, review, users, predict, export, groups, topology, errors."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path

import duckdb
import httpx
import pyarrow.parquet as pq
import pytest

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread
from commlens.backend.attribution import attribute_run, attribution_summary
from commlens.backend.compare import compare
from commlens.backend.findings import findings
from commlens.backend.predict import predict, predict_input_from_config
from commlens.contract.predict import PredictInput
from commlens.frontend.client import ApiClient, ApiProblem, _problem
from commlens.frontend.safe_html import safe_href, to_components
from commlens.ingest.records import ParseResult

MiB = 1 << 20
RUN_JSON = {
    "schema": "commlens.run/1",
    "strategy": "dp2-tp2",
    "world_size": 4,
    "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "parallel": {"dp": 2, "tp": 2},
    "groups": [
        {"dim": "tp", "ranks": [0, 1]},
        {"dim": "tp", "ranks": [2, 3]},
        {"dim": "dp", "ranks": [0, 2]},
        {"dim": "dp", "ranks": [1, 3]},
    ],
}
PREDICT_INPUT = {
    "model": {"layers": 4, "hidden": 256, "heads": 8, "vocab": 1000, "seq_len": 128},
    "parallel": {"dp": 2, "tp": 2},
    "implementation": "paper",
}


def seed(db: Path, run: str = "seeded") -> None:
    """A 2x2 (tp x dp) run written through the store: 4 ranks, 2 steps, plus NCCL communicator rows."""
    con = store.connect(db)
    run_id = store.ensure_run(con, run, description="synthetic 2x2 grid", tags=["synthetic", "grid"])
    groups = [
        {"group_key": f"pg:{k}", "ranks": r, "size": 2, "origin": "pg_config"}
        for k, r in (("tpA", [0, 1]), ("tpB", [2, 3]), ("dpA", [0, 2]), ("dpB", [1, 3]))
    ]
    for rank in range(4):
        tp, dp = ("pg:tpA" if rank < 2 else "pg:tpB"), ("pg:dpA" if rank % 2 == 0 else "pg:dpB")
        events = []
        for step in range(2):
            base = step * 10
            events += [
                {
                    "rank": rank,
                    "process": f"r{rank}",
                    "seq": base + i,
                    "op": "all_reduce",
                    "dtype": "bfloat16",
                    "msg_bytes": 64 * 1024,
                    "group_size": 2,
                    "group_key": tp,
                    "step": step,
                    "ts_us": float(base + i),
                    "dur_us": 20.0,
                    "dur_source": "kernel",
                }
                for i in range(8)
            ]
            events += [
                {
                    "rank": rank,
                    "process": f"r{rank}",
                    "seq": base + 8 + i,
                    "op": "all_reduce",
                    "dtype": "float32",
                    "msg_bytes": 25 * MiB,
                    "group_size": 2,
                    "group_key": dp,
                    "step": step,
                    "ts_us": float(base + 8 + i),
                    "dur_us": 2000.0,
                    "dur_source": "kernel",
                }
                for i in range(2)
            ]
        nccl = [
            {
                "group_key": tp,
                "host": "node0",
                "pid": 100 + rank,
                "comm_rank": rank % 2,
                "nranks": 2,
                "global_rank": rank,
            }
        ]
        result = ParseResult(
            kind="kineto", rank=rank, world_size=4, events=events, groups=groups if rank == 0 else [], nccl_comms=nccl
        )
        store.write_result(
            con, run_id, f"rank{rank}.json", hashlib.sha256(f"{run}{rank}".encode()).hexdigest(), 100, result
        )
    store.set_run_config(con, run_id, RUN_JSON)
    attribute_run(con, run)
    con.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    db = tmp_path_factory.mktemp("api") / "store.duckdb"
    seed(db)
    with ServerThread(Settings(db=db)) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def problem(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["status"] == status and body["title"] and len(body["detail"]) > 10
    return body


def direct(server: ServerThread) -> duckdb.DuckDBPyConnection:
    """A cursor on the server's own database, to call analysis functions directly."""
    return server.app.state.ctx.db.cursor()


# ------------------------------------------------------------------------------------ meta


def test_health_docs_and_openapi(client: httpx.Client) -> None:
    h = client.get("/api/health").json()
    assert h["status"] == "ok" and h["schema_version"] == store.SCHEMA_VERSION
    assert h["auth"] == {"loopback_bind": True, "insecure": False, "users": 0}
    assert "swagger" in client.get("/docs").text.lower()
    paths = client.get("/api/openapi.json").json()["paths"]
    root = client.get("/openapi.json")  # FastAPI's usual place: there, not the dashboard's page
    assert root.status_code == 308 and root.headers["location"] == "/api/openapi.json"
    assert {"/api/runs", "/api/runs/{run}/files", "/api/jobs/{job_id}", "/api/runs/{run}/export"} <= set(paths)
    assert client.get("/api/me").json() == {
        "name": "local",
        "user_id": None,
        "is_admin": True,
        "can_write": True,
        "via": "loopback",
    }


def test_unknown_paths_and_methods_are_problems(client: httpx.Client) -> None:
    assert "see /docs" in problem(client.get("/api/nothing/here"), 404)["detail"]
    body = problem(client.delete("/api/health"), 405)
    assert "GET" in body["detail"]
    assert "no run named 'ghost'" in problem(client.get("/api/runs/ghost"), 404)["detail"]
    assert "no job" in problem(client.get("/api/jobs/abc"), 404)["detail"]


# ------------------------------------------------------------------------------------ runs


def test_create_run_with_run_json_fills_strategy_and_world_size(client: httpx.Client) -> None:
    r = client.post("/api/runs", json={"name": "cfg-run", "tags": ["b", "a", "a"], "config": RUN_JSON})
    assert r.status_code == 201, r.text
    run = r.json()
    assert r.headers["location"] == "/api/runs/cfg-run"
    assert (run["strategy"], run["world_size"], run["config_kind"], run["tags"]) == (
        "dp2-tp2",
        4,
        "run_config",
        ["a", "b"],
    )
    assert run["config"]["parallel"]["tp"] == 2
    r = client.post("/api/runs", json={"name": "whatif", "config": PREDICT_INPUT})
    assert (r.json()["config_kind"], r.json()["world_size"]) == ("predict_input", 4)


def test_create_run_refusals(client: httpx.Client) -> None:
    client.post("/api/runs", json={"name": "dup"})
    assert "exists already" in problem(client.post("/api/runs", json={"name": "dup"}), 409)["detail"]
    body = problem(client.post("/api/runs", json={"name": "x'; DROP TABLE runs; --"}), 422)
    assert body["errors"][0]["field"] == "name"
    bad = dict(RUN_JSON, parallel={"dp": 0})
    assert "run.json" in problem(client.post("/api/runs", json={"name": "badcfg", "config": bad}), 422)["detail"]
    body = problem(client.post("/api/runs", json={"name": "badcfg", "config": {"model": {"layers": 3}}}), 422)
    assert "neither" in body["detail"]
    assert "tags" in problem(client.post("/api/runs", json={"name": "badtag", "tags": ["<b>"]}), 422)["detail"]
    # a trailing newline passed `$`: "a\n" was stored, and "bob\n" became a user beside "bob"
    assert "tags" in problem(client.post("/api/runs", json={"name": "nltag", "tags": ["a\n"]}), 422)["detail"]
    problem(client.post("/api/users", json={"name": "bob\n"}), 422)
    problem(client.post("/api/runs", json={"name": "nl\n"}), 422)
    assert "extra" in problem(client.post("/api/runs", json={"name": "x", "nope": 1}), 422)["detail"].lower()
    # a parameter given twice is refused, not cut to its last value (rank=1 alone was the histogram's filter)
    twice = client.get("/api/runs/seeded/histograms", params=[("rank", "0"), ("rank", "1")])
    assert "query parameter 'rank' is given 2 times" in problem(twice, 422)["detail"]
    assert "comma-separated" in problem(client.get("/api/compare?runs=seeded&runs=seeded"), 422)["detail"]
    # a parameter the route does not take is refused, not ignored (every call came back for `opp`)
    unknown = problem(client.get("/api/runs/seeded/calls", params={"opp": "broadcast"}), 422)
    assert unknown["detail"].startswith("query parameter 'opp' is not one this route takes (it takes: bin, dtype,")
    assert unknown["errors"] == [{"field": "query.opp", "message": "not a parameter of this route"}]
    assert "'bin'" in problem(client.get("/api/runs/seeded/export?format=csv&bin=2%5E20"), 422)["detail"]
    assert client.get("/api/runs/seeded/calls", params={"op": "all_reduce", "limit": 1}).status_code == 200
    assert "(it takes: none)" in problem(client.get("/api/health?verbose=1"), 422)["detail"]
    # an empty strategy and a world size as a string or a boolean were stored
    for field, value in (("strategy", ""), ("world_size", "2"), ("world_size", True)):
        said = problem(client.post("/api/runs", json={"name": "loose", field: value}), 422)
        assert [e["field"] for e in said["errors"]] == [field], said
    json_type = {"content-type": "application/json"}
    # `curl -d '{...}'` without -H sends a form: said as such (it was "Input should be a valid dictionary")
    form = problem(client.post("/api/runs", content=b'{"name": "x"}', headers={"content-type": "text/plain"}), 415)
    assert form["detail"] == (
        "the body is read as JSON: send it with Content-Type: application/json (this request has Content-Type "
        "'text/plain')"
    )
    body = problem(client.post("/api/runs", content=b"name=x", headers=json_type), 422)  # a form, sent as JSON
    assert body["errors"] == [{"field": "body", "message": "not valid JSON at character 0: Expecting value"}]
    body = problem(client.post("/api/runs", content=b'{"name": "x",}', headers=json_type), 422)
    assert body["errors"][0]["field"] == "body" and "character 13" in body["errors"][0]["message"], body
    assert client.get("/api/runs/seeded").status_code == 200  # nothing was dropped


def test_list_runs_paginates_and_searches(client: httpx.Client) -> None:
    for i in range(5):
        client.post(
            "/api/runs", json={"name": f"page-{i}", "tags": ["paged", f"n{i}"], "description": f"pagination {i}"}
        )
    first = client.get("/api/runs", params={"tag": "paged", "limit": 2}).json()
    assert (first["total"], len(first["items"]), first["next_offset"]) == (5, 2, 2)
    names = [
        r["name"]
        for off in (0, 2, 4)
        for r in client.get("/api/runs", params={"tag": "paged", "limit": 2, "offset": off}).json()["items"]
    ]
    assert sorted(names) == [f"page-{i}" for i in range(5)]
    last = client.get("/api/runs", params={"tag": "paged", "limit": 2, "offset": 4}).json()
    assert last["next_offset"] is None
    assert [r["name"] for r in client.get("/api/runs", params={"q": "PAGINATION 3"}).json()["items"]] == ["page-3"]
    assert [r["name"] for r in client.get("/api/runs", params={"q": "n4"}).json()["items"]] == ["page-4"]
    assert client.get("/api/runs", params={"q": "%"}).json()["total"] == 0  # LIKE wildcards are literal
    seeded = next(r for r in client.get("/api/runs", params={"q": "seeded"}).json()["items"])
    assert seeded["sources"] == {"total": 4, "ok": 4, "failed": 0, "by_kind": {"kineto": 4}}
    assert (seeded["events"], seeded["strategy"], seeded["world_size"]) == (80, "dp2-tp2", 4)
    problem(client.get("/api/runs", params={"limit": 0}), 422)


def test_run_detail_and_sources(client: httpx.Client) -> None:
    run = client.get("/api/runs/seeded").json()
    assert run["ops"] == {"all_reduce": 80} and run["ranks"] == 4
    src = client.get("/api/runs/seeded/sources", params={"limit": 3}).json()
    assert src["total"] == 4 and [s["path"] for s in src["items"]] == ["rank0.json", "rank1.json", "rank2.json"]
    assert all(s["status"] == "ok" and s["n_events"] == 20 for s in src["items"])


def test_update_and_delete_run(client: httpx.Client) -> None:
    client.post("/api/runs", json={"name": "to-edit", "description": "old", "tags": ["x"]})
    r = client.patch(
        "/api/runs/to-edit", json={"name": "edited", "description": None, "tags": ["y"], "config": PREDICT_INPUT}
    )
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["description"], r.json()["tags"], r.json()["world_size"]) == (
        "edited",
        None,
        ["y"],
        4,
    )
    old = client.get("/api/runs/to-edit")  # the former name reaches the run (tests/test_ownership.py)
    assert (old.json()["name"], old.json()["aliases"]) == ("edited", ["to-edit"])
    assert "exists" in problem(client.patch("/api/runs/edited", json={"name": "seeded"}), 409)["detail"]
    assert client.delete("/api/runs/edited").status_code == 204
    problem(client.get("/api/runs/edited"), 404)
    problem(client.get("/api/runs/to-edit"), 404)  # deleted with the run
    problem(client.delete("/api/runs/edited"), 404)


@pytest.mark.parametrize("state", ["queued", "running"])
def test_rename_while_ingest_jobs_are_active_is_409(client: httpx.Client, server: ServerThread, state: str) -> None:
    """The worker finds a job's run by the name in its upload manifest: a rename would fail the job."""
    client.post("/api/runs", json={"name": "busy"})
    cur = direct(server)
    run_id = cur.execute("SELECT run_id FROM runs WHERE name = 'busy'").fetchone()[0]
    cur.execute(
        "INSERT INTO jobs (job_id, run_id, state, files_total, bytes_total, results) VALUES (?, ?, ?, 1, 1, '[]')",
        [f"job-{state}", run_id, state],
    )
    try:
        body = problem(client.patch("/api/runs/busy", json={"name": "busy2"}), 409)
        assert body["type"].endswith("/run-busy") and f"job-{state}" in body["detail"] and "rename" in body["detail"]
        problem(client.get("/api/runs/busy2"), 404)
        # other fields may change meanwhile; so may the name once the job is done
        assert client.patch("/api/runs/busy", json={"description": "d"}).json()["description"] == "d"
        assert client.patch("/api/runs/busy", json={"name": "busy"}).status_code == 200  # same name: no rename
        cur.execute("UPDATE jobs SET state = 'done' WHERE job_id = ?", [f"job-{state}"])
        assert client.patch("/api/runs/busy", json={"name": "busy2"}).json()["name"] == "busy2"
    finally:
        cur.execute("DELETE FROM jobs WHERE job_id = ?", [f"job-{state}"])
        cur.close()
    assert client.delete("/api/runs/busy2").status_code == 204


def test_client_shows_the_fields_of_a_validation_problem(server: ServerThread) -> None:
    """The UI's client reads the API's `errors` entries ({"field", "message"}), and says each bad field once."""
    with pytest.raises(ApiProblem) as caught:
        ApiClient(server.url).histogram("seeded", rank=-1)
    p = caught.value
    assert p.status == 422 and "query.rank: Input should be greater than or equal to 0" in p.detail
    assert "None" not in p.detail and "(: " not in p.detail and p.detail.count("query.rank") == 1
    # more bad fields than the detail names: the client adds the others
    r = httpx.post(
        server.url + "/api/runs",
        json={"name": "!", "description": 1, "tags": "x", "world_size": 0, "strategy": 5, "x1": 1, "x2": 2},
    )
    body = r.json()
    assert r.status_code == 422 and len(body["errors"]) == 7
    detail = _problem(r).detail
    assert all(f"{e['field']}: {e['message']}" in detail for e in body["errors"]), detail
    assert all(detail.count(e["field"] + ":") == 1 for e in body["errors"]), detail


# ---------------------------------------------------------------------------------- analysis


def test_groups_match_attribution_and_override_roundtrip(client: httpx.Client, server: ServerThread) -> None:
    got = client.get("/api/runs/seeded/groups").json()
    cur = direct(server)
    summary = json.loads(attribution_summary(cur, "seeded").model_dump_json())
    assert got == {
        "run": "seeded",
        "items": summary["groups"],
        "total": 4,
        "limit": 100,
        "offset": 0,
        "next_offset": None,
        "unattributed_events": summary["unattributed_events"],
        "events_by_scheme": summary["events_by_scheme"],
    }
    assert {g["group_key"]: g["scheme"] for g in got["items"]} == {
        "pg:dpA": "dp",
        "pg:dpB": "dp",
        "pg:tpA": "tp",
        "pg:tpB": "tp",
    }
    pages = [client.get("/api/runs/seeded/groups", params={"limit": 3, "offset": o}).json() for o in (0, 3)]
    assert [(p["total"], p["next_offset"], len(p["items"])) for p in pages] == [(4, 3, 3), (4, None, 1)]
    assert pages[0]["items"] + pages[1]["items"] == got["items"]
    problem(client.get("/api/runs/seeded/groups", params={"limit": 0}), 422)
    r = client.patch("/api/runs/seeded/groups/pg:tpA", json={"scheme": "cp", "reason": "ring attention in fact"})
    assert r.status_code == 200, r.text
    assert (r.json()["scheme"], r.json()["source"]) == ("cp", "override")
    assert attribution_summary(cur, "seeded").groups[2].scheme == "cp"
    no_reason = problem(client.patch("/api/runs/seeded/groups/pg:tpA", json={"scheme": "dp"}), 422)
    assert no_reason["errors"] == [{"field": "reason", "message": "required with a scheme"}]
    problem(client.patch("/api/runs/seeded/groups/pg:tpA", json={"scheme": "zz", "reason": "x"}), 422)
    dropped = client.patch("/api/runs/seeded/groups/pg:tpA", json={"scheme": None, "reason": "undo"})
    assert "keeps no reason" in problem(dropped, 422)["detail"]  # the reason was dropped without a word
    missing = problem(client.patch("/api/runs/seeded/groups/nope", json={"scheme": "tp", "reason": "x"}), 404)
    assert missing["detail"].endswith("'nope'"), missing  # the closing quote was stripped off
    problem(client.patch("/api/runs/seeded/groups/pg:nope", json={"scheme": "dp", "reason": "x"}), 404)
    r = client.patch("/api/runs/seeded/groups/pg:tpA", json={"scheme": None})
    assert (r.json()["scheme"], r.json()["source"]) == ("tp", "label")
    cur.close()


def test_predict_is_the_predictor(client: httpx.Client) -> None:
    r = client.post("/api/predict", json=PREDICT_INPUT)
    assert r.status_code == 200, r.text
    assert r.json() == json.loads(predict(PredictInput.model_validate(PREDICT_INPUT)).model_dump_json())
    bad = {**PREDICT_INPUT, "parallel": {"tp": 3}}
    assert "divisible" in problem(client.post("/api/predict", json=bad), 422)["detail"]
    huge = {**PREDICT_INPUT, "model": {**PREDICT_INPUT["model"], "layers": 50_000_000}}
    assert "at most 4096 layers" in problem(client.post("/api/predict", json=huge), 422)["detail"]
    deep_pp = {**PREDICT_INPUT, "model": {**PREDICT_INPUT["model"], "layers": 1024}, "parallel": {"pp": 1024}}
    assert "pipeline stages" in problem(client.post("/api/predict", json=deep_pp), 422)["detail"]
    # a world of 2^62 ranks was a 500 (MemoryError listing them); 4 M ranks a 30 MB answer
    for dp, where in ((1 << 62, "/api/predict"), (1 << 62, "/api/runs/seeded/comparison"), (1 << 21, "/api/predict")):
        wide = {**PREDICT_INPUT, "parallel": {"dp": dp}}
        said = problem(client.post(where, json=wide), 422)
        assert "more than 10,000,000 ranks" in str(said) if dp > 10**7 else "at most 1,048,576 ranks" in said["detail"]
    config = {**PREDICT_INPUT, "parallel": {"dp": 3_000_000_000}}  # a run's world size from its config: was a 500
    said = problem(client.post("/api/runs", json={"name": "wide", "config": config}), 422)
    assert "more than 10,000,000 ranks" in said["detail"], said
    for shape, rule in (({"kv_heads": 3}, "must divide heads (8)"), ({"ffn_hidden": 0}, "must be at least 1")):
        bad = {**PREDICT_INPUT, "model": {**PREDICT_INPUT["model"], **shape}}
        errors = problem(client.post("/api/predict", json=bad), 422)["errors"]
        assert [e["field"] for e in errors] == ["model." + next(iter(shape))] and rule in errors[0]["message"], errors
        assert problem(client.post("/api/runs", json={"name": "gqa", "config": bad}), 422)


def test_prediction_and_comparison_of_the_runs_config(client: httpx.Client, server: ServerThread) -> None:
    r = client.get("/api/runs/seeded/prediction")
    assert r.status_code == 200, r.text
    assert r.json() == json.loads(predict(predict_input_from_config(RUN_JSON)).model_dump_json())
    cur = direct(server)
    try:
        own = compare(cur, "seeded")
        assert own.config_source == "run" and own.schemes
        assert client.get("/api/runs/seeded/comparison").json() == json.loads(own.model_dump_json())
        what_if = client.post("/api/runs/seeded/comparison", json=PREDICT_INPUT).json()
        assert what_if == json.loads(
            compare(cur, "seeded", PredictInput.model_validate(PREDICT_INPUT)).model_dump_json()
        )
        assert what_if["config_source"] == "supplied"
        page = client.get("/api/runs/seeded/findings").json()
        assert page["items"] == [json.loads(f.model_dump_json()) for f in findings(cur, "seeded", own.findings_input())]
        client.post("/api/runs", json={"name": "bare"})
        both = client.get("/api/compare", params={"runs": "seeded,bare"}).json()["runs"]
        assert [(x["run"], x["strategy"], x["world_size"]) for x in both] == [
            ("seeded", "dp2-tp2", 4),
            ("bare", None, None),
        ]
        assert both[0]["comparison"] == json.loads(own.model_dump_json())
        assert both[1]["comparison"]["config_source"] == "none"
    finally:
        cur.close()
    assert "no configuration" in problem(client.get("/api/runs/bare/prediction"), 409)["detail"]
    problem(client.get("/api/compare", params={"runs": "seeded,ghost"}), 404)
    problem(client.get("/api/compare", params={"runs": ",".join(f"r{i}" for i in range(9))}), 422)
    problem(client.get("/api/compare", params={"runs": "seeded,seeded"}), 422)


def test_promote_a_finding_to_review(client: httpx.Client) -> None:
    found = {f["id"]: f for f in client.get("/api/runs/seeded/findings").json()["items"]}
    f = found["small-messages:tp"]  # eight 64 KiB all_reduces per step on each tp group
    r = client.post(f"/api/runs/seeded/findings/{f['id']}/review")
    assert r.status_code == 201, r.text
    item = r.json()
    assert item["finding"] == f["id"] and f["title"] in item["body"] and f["suggestion"] in item["body"]
    assert {k: v for k, v in item["anchor"].items() if v is not None} == {
        "view": "histograms",
        "scheme": "tp",
        "op": "all_reduce",
    }
    assert "<table>" in item["body_html"]
    rows = [line.split(" | ") for line in item["body"].splitlines() if line.startswith("| ") and "---" not in line]
    shown = {k.strip("| "): v.strip("| ") for k, v in rows[1:]}  # after the header row
    # as the finding card shows them (units, percentages: "wait share 0.966432" read raw), no "None"
    # a key whose text carries its unit is shown without it ("small time us | 1.2 ms" said us beside ms)
    assert shown == {
        (k.removesuffix("_us") if k in f["evidence_text"] else k).replace("_", " "): f["evidence_text"].get(k, str(v))
        for k, v in f["evidence"].items()
        if v is not None
    }
    assert "small time" in shown and not [k for k in shown if k.endswith(" us")]
    assert shown["small call share"] == f["evidence_text"]["small_call_share"] and shown["small call share"].endswith(
        "%"
    )
    problem(client.post(f"/api/runs/seeded/findings/{f['id']}/review"), 409)
    assert client.get("/api/runs/seeded/review", params={"finding": f["id"]}).json()["total"] == 1
    problem(client.post("/api/runs/seeded/findings/no-such/review"), 404)


def test_topology_rows(client: httpx.Client) -> None:
    page = client.get("/api/runs/seeded/topology/comms", params={"group_key": "pg:tpB"}).json()
    assert page["total"] == 2
    rows = [dict(zip(page["columns"], row, strict=True)) for row in page["rows"]]
    assert sorted((r["global_rank"], r["comm_rank"], r["file"]) for r in rows) == [
        (2, 0, "rank2.json"),
        (3, 1, "rank3.json"),
    ]
    problem(client.get("/api/runs/seeded/topology/bogus"), 422)


# ------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_export_matches_comms_view(client: httpx.Client, server: ServerThread, fmt: str) -> None:
    r = client.get("/api/runs/seeded/export", params={"format": fmt, "scheme": "dp", "rank": 1})
    assert r.status_code == 200, r.text
    assert 'filename="seeded.' in r.headers["content-disposition"]
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(r.text)))
    elif fmt == "jsonl":
        rows = [json.loads(line) for line in r.text.splitlines()]
    else:
        rows = pq.read_table(io.BytesIO(r.content)).to_pylist()
    cur = direct(server)
    expected = cur.execute(
        "SELECT msg_bytes, step, group_key FROM comms WHERE run = 'seeded' AND scheme = 'dp' AND rank = 1 "
        "ORDER BY ts_us"
    ).fetchall()
    cur.close()
    assert len(rows) == len(expected) == 4
    assert sorted((int(x["msg_bytes"]), int(x["step"]), x["group_key"]) for x in rows) == sorted(expected)
    assert set(rows[0]) == {
        "run",
        "rank",
        "op",
        "dtype",
        "msg_bytes",
        "elems_in",
        "elems_out",
        "group_size",
        "group_key",
        "scheme",
        "peer",
        "step",
        "ts_us",
        "dur_us",
        "source_kind",
        "file",
    }


def test_export_empty_and_bad_filters(client: httpx.Client) -> None:
    r = client.get("/api/runs/seeded/export", params={"format": "parquet", "dtype": "x' OR '1'='1"})
    assert r.status_code == 200 and pq.read_table(io.BytesIO(r.content)).num_rows == 0
    r = client.get("/api/runs/seeded/export", params={"format": "csv", "op": "send"})
    assert r.text.startswith("run,rank,op") or r.text.startswith('"run","rank"')
    problem(client.get("/api/runs/seeded/export", params={"format": "xml"}), 422)
    problem(client.get("/api/runs/seeded/export", params={"rank": "1; DROP TABLE comm_events"}), 422)
    problem(client.get("/api/runs/nope/export"), 404)


# ------------------------------------------------------------------------------------ review

HOSTILE_MD = (
    "# Finding\n\n<script>alert('x')</script>\n\n<img src=x onerror=alert(1)>\n\n"
    "[click](javascript:alert(1)) and **bold**\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
)


def test_review_markdown_is_stored_verbatim_and_rendered_safely(client: httpx.Client) -> None:
    anchor = {"view": "histograms", "scheme": "dp", "op": "all_reduce", "bin": "2^24", "rank": 1, "free": "step 0"}
    r = client.post("/api/runs/seeded/review", json={"body": HOSTILE_MD, "anchor": anchor})
    assert r.status_code == 201, r.text
    item = r.json()
    assert item["body"] == HOSTILE_MD and item["author"] == "local" and item["status"] == "open"
    assert item["anchor"] == anchor
    html = item["body_html"]
    assert "<script" not in html and "<img" not in html and 'href="javascript' not in html
    assert "&lt;script&gt;" in html and "<strong>bold</strong>" in html and "<table>" in html
    reply = client.post("/api/runs/seeded/review", json={"body": "agreed", "parent_id": item["item_id"]}).json()
    nested = client.post("/api/runs/seeded/review", json={"body": "me too", "parent_id": reply["item_id"]}).json()
    assert nested["parent_id"] == item["item_id"]  # replies hang under the top-level item
    got = client.get(f"/api/review/{item['item_id']}").json()
    assert [x["body"] for x in got["replies"]] == ["agreed", "me too"] and got["replies_total"] == 2
    page = client.get(f"/api/review/{item['item_id']}/replies", params={"limit": 1, "offset": 1}).json()
    assert ([x["body"] for x in page["items"]], page["total"], page["next_offset"]) == (["me too"], 2, None)
    first = client.get(f"/api/review/{item['item_id']}/replies", params={"limit": 1}).json()
    assert ([x["body"] for x in first["items"]], first["next_offset"]) == (["agreed"], 1)
    problem(client.get("/api/review/999999/replies"), 404)
    assert client.patch(f"/api/review/{item['item_id']}", json={"status": "resolved"}).json()["status"] == "resolved"
    listed = client.get("/api/runs/seeded/review", params={"status": "resolved", "scheme": "dp", "rank": 1}).json()
    assert [i["item_id"] for i in listed["items"]] == [item["item_id"]] and len(listed["items"][0]["replies"]) == 2
    assert client.get("/api/runs/seeded/review", params={"status": "resolved", "scheme": "tp"}).json()["total"] == 0
    assert client.delete(f"/api/review/{item['item_id']}").status_code == 204
    problem(client.get(f"/api/review/{reply['item_id']}"), 404)


def test_review_anchor_absent_keeps_it_null_or_empty_removes_it(client: httpx.Client) -> None:
    """The documented PATCH semantics (ReviewUpdate.anchor): {} is no anchor, as null is, on create and update."""
    assert client.post("/api/runs/seeded/review", json={"body": "x", "anchor": {}}).json()["anchor"] is None
    item = client.post("/api/runs/seeded/review", json={"body": "x", "anchor": {"view": "ranks"}}).json()
    url = f"/api/review/{item['item_id']}"
    assert client.patch(url, json={"status": "resolved"}).json()["anchor"]["view"] == "ranks"
    assert client.patch(url, json={"anchor": {}}).json()["anchor"] is None
    assert client.patch(url, json={"anchor": {"op": "all_reduce"}}).json()["anchor"]["op"] == "all_reduce"
    assert client.patch(url, json={"anchor": None}).json()["anchor"] is None
    assert client.delete(url).status_code == 204


def test_long_threads_are_paginated(client: httpx.Client) -> None:
    top = client.post("/api/runs/seeded/review", json={"body": "long thread"}).json()
    for i in range(53):
        client.post("/api/runs/seeded/review", json={"body": f"reply {i}", "parent_id": top["item_id"]})
    inline = client.get(f"/api/review/{top['item_id']}").json()
    assert len(inline["replies"]) == 50 and inline["replies_total"] == 53
    assert [r["body"] for r in inline["replies"]] == [f"reply {i}" for i in range(50)]
    listed = [i for i in client.get("/api/runs/seeded/review").json()["items"] if i["item_id"] == top["item_id"]]
    assert listed[0]["replies"] == inline["replies"] and listed[0]["replies_total"] == 53
    rest = client.get(f"/api/review/{top['item_id']}/replies", params={"offset": 50}).json()
    assert [r["body"] for r in rest["items"]] == ["reply 50", "reply 51", "reply 52"] and rest["total"] == 53
    assert client.delete(f"/api/review/{top['item_id']}").status_code == 204
    problem(client.get(f"/api/review/{top['item_id']}/replies"), 404)


def _hrefs(node) -> list[str]:
    out = [node.href] if getattr(node, "href", None) else []
    children = getattr(node, "children", None)
    for child in children if isinstance(children, list) else [children] if children is not None else []:
        if not isinstance(child, str):
            out += _hrefs(child)
    return out


@pytest.mark.parametrize(
    "href, ok",
    [
        ("/runs/seeded/histograms?scheme=dp", True),
        ("#item-3", True),
        ("https://example.org/a", True),
        ("mailto:a@example.org", True),
        ("//evil.host/x", False),
        ("/\\evil.host", False),
        ("/\t/evil.host", False),
        ("/\n/evil.host", False),
        ("javascript:alert(1)", False),
        ("data:text/html,x", False),
        ("evil.host", False),
    ],
)
def test_safe_html_links(href: str, ok: bool) -> None:
    assert safe_href(href) is ok
    assert _hrefs(to_components(f'<p><a href="{href}">x</a></p>')) == ([href] if ok else [])


def test_review_links_to_other_hosts_are_not_links(client: httpx.Client) -> None:
    """A protocol-relative link in a comment reaches the page as text, not as a link to another host."""
    body = "[a](//evil.host/x) [b](/runs/seeded) [c](https://example.org/) [d](&#47;&#47;evil.host)"
    item = client.post("/api/runs/seeded/review", json={"body": body}).json()
    assert _hrefs(to_components(item["body_html"])) == ["/runs/seeded", "https://example.org/"]
    assert client.delete(f"/api/review/{item['item_id']}").status_code == 204


def test_review_refusals(client: httpx.Client) -> None:
    problem(client.post("/api/runs/seeded/review", json={"body": ""}), 422)
    problem(client.post("/api/runs/seeded/review", json={"body": "x", "anchor": {"bin": "'; DROP"}}), 422)
    # the bins the histograms and /calls know, no other (2^99 was stored, then refused by /calls?bin=)
    body = problem(client.post("/api/runs/seeded/review", json={"body": "x", "anchor": {"bin": "2^99"}}), 422)
    assert body["errors"][0]["field"] == "anchor.bin" and "0 <= k <= 62" in body["errors"][0]["message"], body
    item = client.post("/api/runs/seeded/review", json={"body": "x", "anchor": {"bin": "2^62"}}).json()
    problem(client.patch(f"/api/review/{item['item_id']}", json={"anchor": {"bin": "2^63"}}), 422)
    for field in ("body", "status"):  # a null changed nothing, with a 200
        assert (
            "cannot be null"
            in problem(client.patch(f"/api/review/{item['item_id']}", json={field: None}), 422)["detail"]
        )
    assert client.get(f"/api/review/{item['item_id']}").json()["body"] == "x"
    assert client.delete(f"/api/review/{item['item_id']}").status_code == 204
    problem(client.post("/api/runs/seeded/review", json={"body": "x", "parent_id": 999999}), 422)
    problem(client.post("/api/runs/ghost/review", json={"body": "x"}), 404)
    problem(client.patch("/api/review/999999", json={"status": "open"}), 404)


# ------------------------------------------------------------------------------------- users


def test_users_tokens_and_authorship(client: httpx.Client, server: ServerThread) -> None:
    r = client.post("/api/users", json={"name": "ana"})
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    cur = direct(server)
    stored, ana_id = cur.execute("SELECT token_hash, user_id FROM users WHERE name = 'ana'").fetchone()
    cur.close()
    assert stored == hashlib.sha256(token.encode()).hexdigest() and token not in stored
    ana = {"Authorization": f"Bearer {token}"}
    assert client.get("/api/me", headers=ana).json() == {
        "name": "ana",
        "user_id": ana_id,
        "is_admin": False,
        "can_write": True,
        "via": "token",
    }
    problem(client.get("/api/me", headers={"Authorization": "Bearer nope"}), 401)
    problem(client.get("/api/me", headers={"Authorization": "Basic abc"}), 401)
    mine = client.post("/api/runs/seeded/review", json={"body": "by ana"}, headers=ana).json()
    assert mine["author"] == "ana"
    local = client.post("/api/runs/seeded/review", json={"body": "by local"}).json()
    assert (
        "author"
        in problem(client.patch(f"/api/review/{local['item_id']}", json={"body": "hijack"}, headers=ana), 403)["detail"]
    )
    assert client.patch(f"/api/review/{local['item_id']}", json={"status": "resolved"}, headers=ana).status_code == 200
    problem(client.delete("/api/runs/seeded", headers=ana), 403)
    problem(client.get("/api/users", headers=ana), 403)
    assert "exists" in problem(client.post("/api/users", json={"name": "ana"}), 409)["detail"]
    problem(client.post("/api/users", json={"name": "local"}), 422)
    new = client.post("/api/users/ana/token").json()["token"]
    problem(client.get("/api/me", headers=ana), 401)
    assert client.get("/api/me", headers={"Authorization": f"Bearer {new}"}).json()["name"] == "ana"
    assert [u["name"] for u in client.get("/api/users").json()["items"]] == ["ana"]
    assert client.delete("/api/users/ana").status_code == 204
    problem(client.get("/api/me", headers={"Authorization": f"Bearer {new}"}), 401)


# ---------------------------------------------------------------------------------- rank ranges


@pytest.mark.parametrize("path", ["/api/runs/seeded/ranks", "/api/runs/seeded/time/breakdown"])
def test_an_inverted_rank_range_is_422_naming_first_and_last(client: httpx.Client, path: str) -> None:
    """first > last is the request's mistake, not an empty answer: 422 naming both fields as a bad field is named."""
    body = problem(client.get(path, params={"first": 3, "last": 1}), 422)
    assert body["type"].endswith("/invalid-request")
    assert [e["field"] for e in body["errors"]] == ["query.first", "query.last"]
    assert "query.first: must be at most last (1)" in body["detail"]
    assert "query.last: must be at least first (3)" in body["detail"]
    for params in ({"first": 2, "last": 2}, {"first": 3}, {"last": 1}, {"first": 0, "last": 3}):
        r = client.get(path, params=params)
        assert r.status_code == 200, r.text
        answered = r.json() if path.endswith("/ranks") else r.json()["filters"]
        assert (answered["first"], answered["last"]) == (params.get("first"), params.get("last"))
    ranks = client.get("/api/runs/seeded/ranks", params={"first": 2, "last": 2}).json()
    assert {row["rank"] for row in ranks["rows"]} == {"2"}  # a global rank, or "host:pid" without one
